package policy

import "quotaflow/pkg/limits/internal/hash48"

// Rule is a Limit bound to the place its counter lives: its scope and, for
// endpoint limits, the endpoint. The engine takes Rules; Policy.Resolve
// builds them for a request.
type Rule struct {
	Limit
	Scope    Scope
	Endpoint string // set for endpoint limits (global and per-user), else empty

	// id is ID, kept on every rule Resolve returns: each reserve sends the
	// id of each of its rules, and hashing them was a third of building a
	// reserve call. 0: not kept (a rule built elsewhere).
	id int64
}

// ID names a limit's record inside its blob in Redis: a 48-bit FNV-1a hash
// of what identifies the limit and the layout of its state (scope,
// endpoint, name, kind, window and buckets), but not of its size, so raising
// a limit or moving a user to another plan with a limit of the same name
// keeps the usage. 48 bits keep it exact in Lua's doubles; a blob holds a
// handful of records, so a collision (odds about n^2/2^49) is not a
// practical concern. On a rule Resolve returned it is kept, so change none
// of those fields on such a rule.
func (r *Rule) ID() int64 {
	if r.id != 0 {
		return r.id
	}
	return r.hashID()
}

func (r *Rule) hashID() int64 {
	h := hash48.New()
	h.Mix(string(r.Scope))
	h.Mix(r.Endpoint)
	h.Mix(r.Name)
	h.Mix(string(r.Kind))
	if r.Kind == Rolling || r.Kind == Fixed || r.Kind == SlidingLog {
		h.MixInt(int64(r.Window))
	}
	if r.Kind == Rolling {
		n := r.Buckets
		if n <= 0 {
			n = DefaultBuckets
		}
		h.MixInt(int64(n))
	}
	return h.Sum()
}

// TopUpBalance is the balance limit among a subject's rules that a top-up
// credits: a user-scope balance over a tenant-wide one; nil when there is
// none. Admission credits it, and so does the accounter where Redis lost a
// top-up.
func TopUpBalance(rules []Rule) *Rule {
	var bal *Rule
	for i := range rules {
		if r := &rules[i]; r.Kind == Balance && (bal == nil || r.Scope == ScopeUser) {
			bal = r
		}
	}
	return bal
}
