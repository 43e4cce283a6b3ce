// Package hash48 is FNV-1a over separated fields, cut to 48 bits so that it
// stays exact in Lua's doubles: the ids of limits (policy.Rule.ID) and the
// fingerprints of requests (limits.Fingerprint).
package hash48

import "strconv"

// Hash is a hash in progress.
type Hash uint64

// New returns the empty hash.
func New() Hash { return 14695981039346656037 }

// Mix mixes s in as one field.
func (h *Hash) Mix(s string) {
	v := uint64(*h)
	for i := 0; i < len(s); i++ {
		v ^= uint64(s[i])
		v *= 1099511628211
	}
	v ^= 0xff // separator: ("ab","c") and ("a","bc") differ
	*h = Hash(v * 1099511628211)
}

// MixInt mixes n as its decimal text, formatted on the stack.
func (h *Hash) MixInt(n int64) {
	var num [20]byte
	h.Mix(string(strconv.AppendInt(num[:0], n, 10)))
}

// Sum is the hash's top 48 bits.
func (h Hash) Sum() int64 { return int64(uint64(h) >> 16) }
