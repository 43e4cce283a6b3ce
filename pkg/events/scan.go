package events

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math/bits"
	"time"
	"unicode/utf8"
)

// Decode checks the whole input with validate first; the scanner below
// then only walks JSON known to be valid, which keeps it short and lets
// Decode run without reflection or a tokenizer (it sits on every
// consumer's hot path).

// member is one key and raw value of a JSON object.
type member struct {
	key []byte // unescaped; a slice of the input when it had no escapes
	val []byte
}

// object returns the members of the JSON object b (valid JSON), in order,
// rejecting a non-object and duplicate keys. The objects of one event
// share one arena (one allocation, not one each): *free is its unused
// room, which object takes its members from (growing it when they do not
// fit) and leaves past them. b is a slice of the validated text whose
// containers s holds (nil: none recorded).
func object(b []byte, s *spans, free *[]member) ([]member, error) {
	i := skipSpace(b, 0)
	if i == len(b) || b[i] != '{' {
		return nil, errors.New("must be a JSON object")
	}
	ms := (*free)[:0]
	var seen map[string]bool // beyond a few members, instead of a linear search
	var met uint64           // the keyBit of every key so far
	i = skipSpace(b, i+1)
	for b[i] != '}' {
		end, escaped := scanString(b, i)
		key := b[i+1 : end-1]
		if escaped {
			var u string
			_ = json.Unmarshal(b[i:end], &u) // valid JSON: cannot fail
			key = []byte(u)
		}
		if seen == nil && len(ms) == 16 {
			seen = make(map[string]bool, 64)
			for _, m := range ms {
				seen[string(m.key)] = true
			}
		}
		dup := false
		if seen != nil {
			dup = seen[string(key)]
			seen[string(key)] = true
		} else if bit := keyBit(key); met&bit == 0 {
			met |= bit // no key before had its bit: no need to compare
		} else {
			for _, m := range ms {
				if string(m.key) == string(key) {
					dup = true
					break
				}
			}
		}
		if dup {
			return nil, fmt.Errorf("duplicate key %q", short(string(key)))
		}
		i = skipSpace(b, skipSpace(b, end)+1) // past ':'
		vend := skipAt(b, i, s)
		ms = append(ms, member{key: key, val: b[i:vend]})
		i = skipSpace(b, vend)
		if b[i] == ',' {
			i = skipSpace(b, i+1)
		}
	}
	*free = ms[len(ms):]
	return ms[:len(ms):len(ms)], nil
}

// keyBit returns one of 64 bits for key, by its length and its first
// and last bytes, so that object compares a key only with earlier ones
// when another key had its bit.
func keyBit(key []byte) uint64 {
	h := len(key)
	if h > 0 {
		h = h*7 + int(key[0]) + int(key[h-1])
	}
	return 1 << (h & 63)
}

// elements returns the raw elements of the JSON array b (valid JSON), or
// false when b is not an array; s as for object.
func elements(b []byte, s *spans) ([][]byte, bool) {
	i := skipSpace(b, 0)
	if i == len(b) || b[i] != '[' {
		return nil, false
	}
	var out [][]byte
	i = skipSpace(b, i+1)
	for b[i] != ']' {
		end := skipAt(b, i, s)
		out = append(out, b[i:end])
		i = skipSpace(b, end)
		if b[i] == ',' {
			i = skipSpace(b, i+1)
		}
	}
	return out, true
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// scanString returns the index just past the string that starts at b[i]
// (a quote), and whether it holds escapes.
func scanString(b []byte, i int) (end int, escaped bool) {
	i = plain(b, i+1)
	for ; i < len(b); i++ {
		switch b[i] {
		case '\\':
			escaped = true
			i++
		case '"':
			return i + 1, escaped
		}
	}
	return i, escaped
}

// skipAt is skipValue for b, a slice of a validated text: a container's
// end is looked up in s, when s recorded it.
func skipAt(b []byte, i int, s *spans) int {
	if s != nil && (b[i] == '{' || b[i] == '[') {
		at := s.offset(b)
		if end := s.after(at+i) - at; end > i && end <= len(b) {
			return end
		}
	}
	return skipValue(b, i)
}

// Scanning strings a byte at a time led the consumers' decoding, so the
// scanners step over the plain part of a string eight bytes at a time.
const (
	ones  = 0x0101010101010101
	highs = 0x8080808080808080
)

// plain returns the index of the first byte from b[i] on that is '"', '\\'
// or a control character (under 0x20), or one among the last 7 bytes (or
// len(b)) from which the caller goes on a byte at a time.
func plain(b []byte, i int) int {
	for ; i+8 <= len(b); i += 8 {
		x := binary.LittleEndian.Uint64(b[i:])
		q, e := x^(ones*'"'), x^(ones*'\\')
		// The high bit of the first byte that is zero in q or e, or under
		// 0x20 in x, is the lowest bit set here (Bit Twiddling Hacks:
		// haszero, hasless; a borrow only sets bits above such a byte).
		if m := ((q-ones)&^q | (e-ones)&^e | (x-ones*0x20)&^x) & highs; m != 0 {
			return i + bits.TrailingZeros64(m)/8
		}
	}
	return i
}

// skipValue returns the index just past the value that starts at b[i].
func skipValue(b []byte, i int) int {
	switch b[i] {
	case '"':
		end, _ := scanString(b, i)
		return end
	case '{', '[':
		depth := 0
		for i < len(b) {
			switch b[i] {
			case '"':
				i, _ = scanString(b, i)
				continue
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return i + 1
				}
			}
			i++
		}
		return i
	}
	for i < len(b) { // number, true, false, null
		switch b[i] {
		case ',', '}', ']', ' ', '\t', '\n', '\r':
			return i
		}
		i++
	}
	return i
}

// reader takes typed fields out of a decoded JSON object, deferring type
// errors to its checker. Absent and null fields read as zero values.
type reader struct {
	c    checker
	m    []member
	next int       // where raw's next search starts
	free *[]member // the event's arena (object)
	// spans holds the containers of the validated text m points into.
	spans *spans
	// names, when not nil, holds the strings that name met before (in the
	// earlier events of a batch), to share them.
	names map[string]string
	// noSnapshots skips limit snapshots (Decoder.NoSnapshots).
	noSnapshots bool
}

// raw returns the field unless it is absent or null. The search starts
// past the field found last: readers ask for the fields in the order the
// encoder writes them, so a present field is most often the next one.
func (r *reader) raw(name string) ([]byte, bool) {
	for i, j := 0, r.next; i < len(r.m); i, j = i+1, j+1 {
		if j == len(r.m) {
			j = 0
		}
		if m := r.m[j]; string(m.key) == name {
			r.next = j + 1
			if string(m.val) == "null" {
				return nil, false
			}
			return m.val, true
		}
	}
	return nil, false
}

func (r *reader) str(name string) string {
	v, ok := r.raw(name)
	if !ok {
		return ""
	}
	if v[0] != '"' {
		r.c.deferProblem(name, "must be a string")
		return ""
	}
	if _, escaped := scanString(v, 0); !escaped {
		return string(v[1 : len(v)-1])
	}
	var s string
	_ = json.Unmarshal(v, &s) // valid JSON string: cannot fail
	return s
}

// oneOf is str for a field whose values come from a small set: the value
// is returned as the one of known it equals, without allocating (such
// fields are most of the strings a reserved event holds), else as str
// reads it.
func (r *reader) oneOf(name string, known []string) string {
	if v, ok := r.raw(name); ok && len(v) >= 2 && v[0] == '"' {
		for _, k := range known {
			if string(v[1:len(v)-1]) == k {
				return k
			}
		}
	}
	return r.str(name)
}

// The small sets of values that oneOf reads without allocating.
var (
	specVersions = []string{SpecVersion}
	types        = []string{TypeReserved, TypeActual, TypeDenied, TypeReleased, TypeCorrected, TypeTopUp}
	contentTypes = []string{DataContentType}
	scopes       = []string{"user", "tenant", "global", "ip"}
	units        = []string{"tokens", "requests"}
)

// int reads an integer. A fraction, an exponent, more than 18 digits or a
// non-number is a problem, and so is a missing required one: 0 must be
// written out, so that a misspelt key is not read as zero.
func (r *reader) int(name string, required bool) int64 {
	v, ok := r.raw(name)
	if !ok {
		if required {
			r.c.deferProblem(name, "required")
		}
		return 0
	}
	n, ok := parseInt(v)
	if !ok {
		r.c.deferProblem(name, "must be an integer")
	}
	return n
}

// parseInt parses a JSON integer of up to 18 digits, which always fits an
// int64 (valid limits stop at 13 digits).
func parseInt(v []byte) (int64, bool) {
	neg := v[0] == '-'
	if neg {
		v = v[1:]
	}
	if len(v) == 0 || len(v) > 18 {
		return 0, false
	}
	var n int64
	for _, ch := range v {
		if ch < '0' || ch > '9' {
			return 0, false
		}
		n = n*10 + int64(ch-'0')
	}
	if neg {
		n = -n
	}
	return n, true
}

func (r *reader) time(name string) time.Time {
	v, ok := r.raw(name)
	if !ok {
		return time.Time{}
	}
	var t time.Time
	if v[0] != '"' {
		r.c.deferProblem(name, "must be an RFC 3339 time")
		return t
	}
	text := v[1 : len(v)-1]
	if _, escaped := scanString(v, 0); escaped {
		var s string
		_ = json.Unmarshal(v, &s) // valid JSON string: cannot fail
		text = []byte(s)
	}
	if t.UnmarshalText(text) != nil { // strict RFC 3339
		r.c.deferProblem(name, "must be an RFC 3339 time")
		return time.Time{}
	}
	return t
}

// maxNames bounds the strings one batch's readers share (reader.name).
const maxNames = 256

// name reads a string field that repeats from one event of a batch to
// the next (a limit's name or endpoint): one copy serves them all.
func (r *reader) name(field string) string {
	v, ok := r.raw(field)
	if !ok || r.names == nil || v[0] != '"' {
		return r.str(field)
	}
	if _, escaped := scanString(v, 0); escaped {
		return r.str(field)
	}
	if s, ok := r.names[string(v[1:len(v)-1])]; ok {
		return s
	}
	s := string(v[1 : len(v)-1])
	if len(r.names) < maxNames {
		r.names[s] = s
	}
	return s
}

// array calls size with the number of elements of the array name, then
// each with a reader for every element, which must be an object; with
// nil for an element that is not one, so later elements keep their
// indexes. An empty array reads as an absent one: neither is called.
func (r *reader) array(name string, size func(n int), each func(*reader)) {
	v, ok := r.raw(name)
	if !ok {
		return
	}
	items, ok := elements(v, r.spans)
	if !ok {
		r.c.deferProblem(name, "must be an array")
		return
	}
	if len(items) == 0 {
		return // as absent: Encode omits an empty list, so a round trip keeps nil
	}
	size(len(items))
	for i, it := range items {
		m, err := object(it, r.spans, r.free)
		if err != nil {
			r.c.deferProblem(fmt.Sprintf("%s[%d]", name, i), err.Error())
			each(nil)
			continue
		}
		each(&reader{c: r.c.item(name, i), m: m, free: r.free, spans: r.spans, names: r.names})
	}
}

// short cuts s for an error message.
func short(s string) string {
	const n = 64
	if len(s) <= n {
		return s
	}
	i := n
	for i > 0 && !utf8.RuneStart(s[i]) {
		i--
	}
	return s[:i] + "…"
}
