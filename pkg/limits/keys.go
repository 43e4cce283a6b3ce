package limits

import (
	"strconv"
	"strings"
)

// Key layout. Every key starts with "q" and a Redis Cluster hash tag:
//
//	q{T}u:U       blob of user U's limits (plan limits, endpoint per-user
//	              limits) and U's version, tenant T
//	q{T}t         blob of tenant T's tenant-wide limits and its version
//	q{T}r:U:R     reservation record of request R of user U
//	q{T}z:U:L     sorted set of user U's concurrency limit L (q{T}Z:L for a
//	              tenant-wide one)
//	q{T}b:R       marker of the balance top-up with reference R
//	q{%gE}        blob of endpoint E's global limits
//	q{%iA}        blob of client IP A's limits
//	qe{S}         epoch key of the cluster slot that tag S hashes to (epoch.go)
//
// A blob holds the state of several limits, one record each, named by a
// 48-bit hash of the limit's identity (ruleID); see lua/lib.lua.
//
// Identifiers are escaped (esc) so that no two different tenants, users,
// endpoints or request ids ever produce the same key, whatever characters
// they contain, and so that a tenant can never choose the tag of another
// tenant or of a shared scope: escaped text holds no '{', '}' or ':', and its
// '%' is always followed by two hex digits, so the "%g" and "%i" tags of the
// shared scopes cannot be spelled by a tenant.

// esc percent-escapes the bytes that carry meaning in a key.
func esc(s string) string {
	if !strings.ContainsAny(s, "%{}:") {
		return s
	}
	var b strings.Builder
	b.Grow(len(s) + 8)
	for i := 0; i < len(s); i++ {
		switch c := s[i]; c {
		case '%':
			b.WriteString("%25")
		case '{':
			b.WriteString("%7B")
		case '}':
			b.WriteString("%7D")
		case ':':
			b.WriteString("%3A")
		default:
			b.WriteByte(c)
		}
	}
	return b.String()
}

// subjectKeys builds the keys of one (tenant, user).
type subjectKeys struct {
	prefix string // q{T}
	user   string // escaped user
}

func newSubjectKeys(tenant, user string) subjectKeys {
	return subjectKeys{prefix: "q{" + esc(tenant) + "}", user: esc(user)}
}

// tag returns the hash tag's content, which decides the cluster slot.
func (k subjectKeys) tag() string { return k.prefix[2 : len(k.prefix)-1] }

func (k subjectKeys) blob() string       { return k.prefix + "u:" + k.user }
func (k subjectKeys) tenantBlob() string { return k.prefix + "t" }

func (k subjectKeys) reservation(requestID string) string {
	return k.prefix + "r:" + k.user + ":" + esc(requestID)
}

// concurrency returns the sorted set of a concurrency limit.
func (k subjectKeys) concurrency(r *Rule) string {
	if r.Scope == ScopeTenant {
		return k.prefix + "Z:" + limitPath(r)
	}
	return k.prefix + "z:" + k.user + ":" + limitPath(r)
}

func (k subjectKeys) topup(reference string) string {
	return k.prefix + "b:" + esc(reference)
}

// limitPath names a limit within its scope: endpoint limits carry their
// endpoint, so they never share a counter with a plan limit of that name.
func limitPath(r *Rule) string {
	if r.Endpoint != "" {
		return "e:" + esc(r.Endpoint) + ":" + esc(r.Name)
	}
	return esc(r.Name)
}

// sharedTag returns the hash tag content of a shared (global or IP) scope.
// Each endpoint and each IP has its own tag, so a cluster spreads them.
func sharedTag(scope Scope, id string) string {
	if scope == ScopeIP {
		return "%i" + esc(id)
	}
	return "%g" + esc(id)
}

func sharedBlob(tag string) string { return "q{" + tag + "}" }

// ruleID names a limit's record inside its blob: a 48-bit FNV-1a hash of
// what identifies the limit and the layout of its state (scope, endpoint,
// name, kind, window and buckets), but not of its size, so raising a limit
// or moving a user to another plan with a limit of the same name keeps the
// usage. 48 bits keep it exact in Lua's doubles; a blob holds a handful of
// records, so a collision (odds about n^2/2^49) is not a practical concern.
func ruleID(r *Rule) int64 {
	h := newHash48()
	h.mix(string(r.Scope))
	h.mix(r.Endpoint)
	h.mix(r.Name)
	h.mix(string(r.Kind))
	if r.Kind == Rolling || r.Kind == Fixed || r.Kind == SlidingLog {
		h.mixInt(int64(r.Window))
	}
	if r.Kind == Rolling {
		h.mixInt(int64(buckets(r)))
	}
	return h.sum()
}

// Fingerprint identifies the request a request id stands for, by its
// endpoint, plan, model and cost (a 48-bit hash, as Request.Fingerprint
// wants): a Reserve of an open reservation's id is a Duplicate only with
// the same fingerprint.
func Fingerprint(endpoint, plan, model string, cost int64) int64 {
	h := newHash48()
	h.mix(endpoint)
	h.mix(plan)
	h.mix(model)
	h.mixInt(cost)
	return h.sum()
}

// hash48 is FNV-1a over separated fields, cut to 48 bits so that it stays
// exact in Lua's doubles.
type hash48 uint64

func newHash48() hash48 { return 14695981039346656037 }

func (h *hash48) mix(s string) {
	v := uint64(*h)
	for i := 0; i < len(s); i++ {
		v ^= uint64(s[i])
		v *= 1099511628211
	}
	v ^= 0xff // separator: ("ab","c") and ("a","bc") differ
	*h = hash48(v * 1099511628211)
}

// mixInt mixes n as its decimal text, formatted on the stack: a Reserve
// hashes every limit it checks.
func (h *hash48) mixInt(n int64) {
	var num [20]byte
	h.mix(string(strconv.AppendInt(num[:0], n, 10)))
}

func (h hash48) sum() int64 { return int64(uint64(h) >> 16) }
