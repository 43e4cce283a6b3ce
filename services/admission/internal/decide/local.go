package decide

import (
	"hash/maphash"
	"math"
	"sync"
	"time"

	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
)

// Local state: what the Decider knows without Redis, per owner (a subject, a
// tenant, an IP or an endpoint) and limit.
//
//   - Token limits of a subject or tenant (quotas, balances): the remaining
//     last seen in a Redis decision, spent down locally during an outage,
//     and back to the full limit once the window it was seen in has passed.
//     An owner never seen gets UnseenAllowance.
//   - Every other limit (request limits of any scope, token limits of shared
//     scopes): this instance's share, a token bucket of capacity
//     ceil(capacity / Instances) that refills that much per window (for a
//     token bucket limit: at rate / Instances).
//   - Concurrency limits are not enforced locally: nothing could release a
//     slot taken without Redis.
//
// A limit decided locally reports Remaining as what this instance may still
// allow, and Used as the usage it knows of: what was used when Redis was
// last seen plus its own spending since, or its own spending alone for an
// owner never seen and for a share. Never limit - remaining: for an owner
// never seen that would claim a nearly full quota (docs/design.md §4: used is real
// usage after the decision).

// ownerKey names the owner of local state.
type ownerKey struct {
	scope policy.Scope
	a, b  string // ip: address; global: endpoint; tenant: tenant; user: tenant, user
}

// ruleKey identifies a limit across policy reloads, like the engine's record
// id: a limit whose size changes keeps its state, one whose kind or window
// changes starts afresh.
type ruleKey struct {
	scope          policy.Scope
	endpoint, name string
	kind           policy.Kind
	unit           policy.Unit
	window         policy.Duration
}

var hashSeed = maphash.MakeSeed()

// ruleID hashes a rule's identity; collisions among an owner's handful of
// limits (odds about n²/2⁶⁵) are not a practical concern.
func ruleID(r *policy.Rule) uint64 {
	return maphash.Comparable(hashSeed, ruleKey{r.Scope, r.Endpoint, r.Name, r.Kind, r.Unit, r.Window})
}

// ruleState is the local state of one limit of one owner.
type ruleState struct {
	id      uint64
	init    bool
	seen    bool    // quota: left came from a Redis decision
	left    float64 // units still allowed locally
	at      int64   // share: last refill (monotonic ns)
	resetAt int64   // quota: when the window seen frees everything (0: never)
}

// entry is the local state of one owner. Its mutex makes a local decision
// over several limits all-or-nothing.
type entry struct {
	mu    sync.Mutex
	rules []*ruleState // pointers stay valid as rules are added
}

// state returns the state of rule id, adding it; caller holds mu.
func (e *entry) state(id uint64) *ruleState {
	for _, st := range e.rules {
		if st.id == id {
			return st
		}
	}
	st := &ruleState{id: id}
	if e.rules == nil {
		e.rules = make([]*ruleState, 0, 4) // a plan's handful of limits, without regrowing
	}
	e.rules = append(e.rules, st)
	return st
}

// localShards spreads the owner map over this many mutexes.
const localShards = 64

// localCache maps owners to entries, bounded: each shard keeps a current and
// a previous generation of at most max entries; when the current one fills
// up it becomes the previous one and the old previous one is dropped. A hit
// in the previous generation moves the entry forward. So the least recently
// used entries go first, with O(1) work and no list.
type localCache struct {
	max    int
	shards [localShards]localShard
}

type localShard struct {
	mu       sync.Mutex
	cur, old map[ownerKey]*entry
}

func newLocalCache(entries int) *localCache {
	c := &localCache{max: max(1, entries/(2*localShards))}
	for i := range c.shards {
		c.shards[i].cur = make(map[ownerKey]*entry)
	}
	return c
}

// get returns the entry of k, creating it when create is set (else nil if
// absent).
func (c *localCache) get(k ownerKey, create bool) *entry {
	s := &c.shards[maphash.Comparable(hashSeed, k)%localShards]
	s.mu.Lock()
	defer s.mu.Unlock()
	if e := s.cur[k]; e != nil {
		return e
	}
	e := s.old[k]
	if e == nil && !create {
		return nil
	}
	if e == nil {
		e = &entry{}
	}
	if len(s.cur) >= c.max {
		s.old, s.cur = s.cur, make(map[ownerKey]*entry, c.max)
	}
	s.cur[k] = e
	return e
}

func (c *localCache) len() int {
	n := 0
	for i := range c.shards {
		s := &c.shards[i]
		s.mu.Lock()
		n += len(s.cur) + len(s.old)
		s.mu.Unlock()
	}
	return n
}

// capacity is what a limit admits when empty.
func capacity(r *policy.Rule) int64 {
	if r.Kind == policy.TokenBucket {
		return r.Burst
	}
	return r.Limit.Limit
}

// period is how long a limit takes to free its whole capacity.
func period(r *policy.Rule) time.Duration {
	switch r.Kind {
	case policy.Rolling, policy.Fixed, policy.SlidingLog:
		return time.Duration(r.Window)
	case policy.CalendarMonth:
		return 31 * 24 * time.Hour
	case policy.TokenBucket:
		if r.Rate > 0 {
			return time.Duration(float64(r.Burst) / r.Rate * float64(r.Per))
		}
		return time.Duration(r.Per)
	}
	return 0
}

// quotaKind reports whether a limit is decided locally from the remaining
// last seen (token limits of a subject or tenant) rather than from a share.
func quotaKind(r *policy.Rule) bool {
	return r.Unit == policy.Tokens && (r.Scope == policy.ScopeUser || r.Scope == policy.ScopeTenant)
}

// unitCost is what a request costs in a limit.
func unitCost(r *policy.Rule, cost int64) int64 {
	if r.Unit == policy.Tokens {
		return cost
	}
	return 1
}

// shareCap and shareRate size this instance's share of a limit.
func (d *Decider) shareCap(r *policy.Rule) float64 {
	return math.Ceil(float64(capacity(r)) / float64(d.opt.Instances))
}

// shareRate is the refill of a share in units per nanosecond.
func (d *Decider) shareRate(r *policy.Rule) float64 {
	if r.Kind == policy.TokenBucket && r.Rate > 0 {
		return r.Rate / float64(d.opt.Instances) / float64(r.Per)
	}
	p := period(r)
	if p <= 0 {
		return 0
	}
	return d.shareCap(r) / float64(p)
}

// unspent is what a limit's local state holds with nothing spent: the
// whole limit once Redis showed the owner's usage (left then counts down
// from it), the allowance for an owner never seen, the share otherwise.
func (d *Decider) unspent(r *policy.Rule, st *ruleState) float64 {
	switch {
	case !quotaKind(r):
		return d.shareCap(r)
	case st.seen:
		return float64(capacity(r))
	}
	return d.allowance(r)
}

// allowance is what a quota of an owner never seen starts with.
func (d *Decider) allowance(r *policy.Rule) float64 {
	if r.Kind == policy.Balance { // a balance's credits are unknown here
		return float64(d.opt.UnseenAllowance)
	}
	return float64(min(d.opt.UnseenAllowance, capacity(r)))
}

// bring moves a limit's local state forward to now (monotonic ns); caller
// holds the entry's mutex.
func (d *Decider) bring(r *policy.Rule, st *ruleState, now int64) {
	if quotaKind(r) {
		if !st.init {
			st.init, st.left = true, d.allowance(r)
		}
		if st.resetAt != 0 && now >= st.resetAt {
			st.left = float64(capacity(r))
			st.resetAt = now + int64(period(r))
		}
		return
	}
	c := d.shareCap(r)
	if !st.init {
		st.init, st.left, st.at = true, c, now
		return
	}
	if now > st.at {
		st.left = min(c, st.left+float64(now-st.at)*d.shareRate(r))
		st.at = now
	}
}

// localCheck decides rules locally for one request of cost: all-or-nothing,
// shadow limits never deny. owners[0] holds tenant-scope limits, owners[1]
// every other one (a single owner for shared layers may be given as both).
// Caller holds both owners' mutexes. It fills out (one state per rule) and
// returns the index of the first denying rule (-1: allowed), the wait and
// the reason. When allowed, the cost is spent and added to spends.
func (d *Decider) localCheck(owners [2]*entry, rules []policy.Rule, cost int64, now int64, out []LimitState, spends *[]localSpend) (denied int, retry time.Duration, reason limits.Reason) {
	denied = -1
	sts := make([]*ruleState, len(rules))
	for i := range rules {
		r := &rules[i]
		out[i] = LimitState{Scope: r.Scope, Name: r.Name, Endpoint: r.Endpoint, Unit: r.Unit, Limit: capacity(r), Shadow: r.Shadow}
		if r.Kind == policy.Concurrency {
			out[i].Remaining = r.Limit.Limit // not enforced locally
			continue
		}
		if r.Kind == policy.Balance {
			out[i].Limit = 0
		}
		e := owners[1]
		if r.Scope == policy.ScopeTenant {
			e = owners[0]
		}
		st := e.state(ruleID(r))
		d.bring(r, st, now)
		sts[i] = st
		need := float64(unitCost(r, cost))
		if st.left >= need {
			continue
		}
		if r.Shadow {
			out[i].WouldDeny = true
			continue
		}
		w, why := d.localWait(r, st, need, now)
		if denied < 0 {
			denied, reason = i, why
		}
		if why == limits.ReasonNone && reason == limits.ReasonNone {
			retry = max(retry, w)
		}
	}
	if reason != limits.ReasonNone {
		retry = 0
	}
	for i := range rules {
		st := sts[i]
		if st == nil {
			continue
		}
		r := &rules[i]
		need := float64(unitCost(r, cost))
		if denied < 0 && st.left >= need {
			st.left -= need
			e := owners[1]
			if r.Scope == policy.ScopeTenant {
				e = owners[0]
			}
			*spends = append(*spends, localSpend{e: e, id: st.id, n: need, at: i})
		}
		left := int64(math.Floor(max(0, st.left)))
		out[i].Remaining = left
		if r.Kind == policy.Balance {
			out[i].Limit = left // credits unknown locally: report what is left
		} else {
			out[i].Used = max(0, int64(d.unspent(r, st))-left)
		}
		if st.resetAt > now {
			out[i].Reset = time.Duration(st.resetAt - now)
		} else if !quotaKind(r) && st.left < d.shareCap(r) {
			if rate := d.shareRate(r); rate > 0 {
				out[i].Reset = time.Duration((d.shareCap(r) - st.left) / rate)
			}
		}
	}
	return denied, retry, reason
}

// localWait says how long until need units fit in a limit decided locally,
// or why waiting does not help.
func (d *Decider) localWait(r *policy.Rule, st *ruleState, need float64, now int64) (time.Duration, limits.Reason) {
	if r.Kind == policy.Balance {
		return 0, limits.ReasonInsufficientBalance
	}
	if need > float64(capacity(r)) {
		return 0, limits.ReasonCostExceedsLimit
	}
	if quotaKind(r) {
		if st.resetAt > now {
			return time.Duration(st.resetAt - now), limits.ReasonNone
		}
		// Never seen, allowance spent: ask again once Redis may be back.
		return max(time.Second, d.opt.BreakerCooldown), limits.ReasonNone
	}
	if need > d.shareCap(r) {
		return period(r), limits.ReasonNone
	}
	if rate := d.shareRate(r); rate > 0 {
		return time.Duration(math.Ceil((need - st.left) / rate)), limits.ReasonNone
	}
	return period(r), limits.ReasonNone
}

// localSpend is a local spending to give back when a later layer denies.
type localSpend struct {
	e  *entry
	id uint64
	n  float64
	at int // localCheck: the index of its rule; then its slot in Result.Limits
}

// remember records the remaining of the token limits of a subject and its
// tenant from a Redis decision, for local decisions during an outage.
func (d *Decider) remember(tenant, user string, states []limits.State, now int64) {
	var te, ue *entry
	for i := range states {
		s := &states[i]
		r := s.Rule
		if !quotaKind(r) {
			continue
		}
		var e *entry
		if r.Scope == policy.ScopeTenant {
			if te == nil {
				te = d.local.get(ownerKey{scope: policy.ScopeTenant, a: tenant}, true)
			}
			e = te
		} else {
			if ue == nil {
				ue = d.local.get(ownerKey{scope: policy.ScopeUser, a: tenant, b: user}, true)
			}
			e = ue
		}
		var reset int64
		switch r.Kind {
		case policy.Balance:
		case policy.Rolling, policy.SlidingLog:
			reset = now + int64(time.Duration(r.Window))
		default: // fixed, calendar_month, token_bucket: Reset is when it is empty again
			reset = now + int64(s.Reset)
		}
		e.mu.Lock()
		st := e.state(ruleID(r))
		st.init, st.seen, st.left, st.resetAt = true, true, float64(s.Remaining), reset
		e.mu.Unlock()
	}
}
