package decide

import (
	"hash/maphash"
	"math"
	"slices"
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

// stateID tells an owner's limit states apart: ruleID folded to 32 bits, so
// that a state takes 24 bytes rather than 32. Two limits of one owner
// collide with odds about n²/2³³ for its n limits (10⁻⁸ for ten); they
// would then share local state, which only matters while Redis is
// unavailable.
func stateID(r *policy.Rule) uint32 {
	h := ruleID(r)
	return uint32(h ^ h>>32)
}

// ruleState is the local state of one limit of one owner, 24 bytes without
// a pointer.
type ruleState struct {
	left float64 // units still allowed locally
	// t is, for a quota, when the window seen frees everything (0: never);
	// for a share, its last refill. Monotonic ns.
	t    int64
	id   uint32 // stateID
	init bool
	seen bool // quota: left came from a Redis decision
}

// inlineStates is how many limit states an entry holds in its own
// allocation: a subject remembers its token quotas, usually this few (three
// in the benchmarks' five-limit plan), so most owners cost one 96-byte
// object (BenchmarkRemember).
const inlineStates = 3

// entry is the local state of one owner. Its mutex makes a local decision
// over several limits all-or-nothing.
type entry struct {
	mu     sync.Mutex
	n      int // states held: inline first, then more
	inline [inlineStates]ruleState
	more   *[]ruleState // the states past inlineStates, by value: adding one may move the others
}

// at returns state i; caller holds mu, and the pointer is good until the
// next state is added.
func (e *entry) at(i int) *ruleState {
	if i < inlineStates {
		return &e.inline[i]
	}
	return &(*e.more)[i-inlineStates]
}

// index returns the index of state id, adding it; caller holds mu. An
// index stays valid as states are added, a pointer from at may not.
func (e *entry) index(id uint32) int {
	for i := range e.n {
		if e.at(i).id == id {
			return i
		}
	}
	if e.n < inlineStates {
		e.inline[e.n] = ruleState{id: id}
	} else {
		if e.more == nil {
			e.more = new([]ruleState)
		}
		*e.more = append(*e.more, ruleState{id: id})
	}
	e.n++
	return e.n - 1
}

// state returns the state of id, adding it; caller holds mu, and the
// pointer is good until the next state is added.
func (e *entry) state(id uint32) *ruleState { return e.at(e.index(id)) }

// localShards spreads the owner map over this many mutexes.
const localShards = 64

// localCache maps owners to entries, bounded: each shard keeps a current and
// a previous generation of at most max entries; when the current one fills
// up it becomes the previous one and the old previous one is dropped. A hit
// in the previous generation moves the entry forward. So the least recently
// used entries go first, with O(1) work and no list.
//
// Owners are kept by a 64-bit hash of their key, not the key: the cache
// holds no strings (a request's tenant and user do not outlive it) and a
// slot is 16 bytes, which keeps 100k owners' state in about 13 MB. Two owners
// whose hashes collide (odds about n²/2⁶⁵ for n entries) share their local
// state, which only matters while Redis is unavailable.
type localCache struct {
	max    int
	shards [localShards]localShard
}

type localShard struct {
	mu       sync.Mutex
	cur, old map[uint64]*entry
}

func newLocalCache(entries int) *localCache {
	c := &localCache{max: max(1, entries/(2*localShards))}
	for i := range c.shards {
		c.shards[i].cur = make(map[uint64]*entry)
	}
	return c
}

// get returns the entry of k, creating it when create is set (else nil if
// absent).
func (c *localCache) get(k ownerKey, create bool) *entry {
	h := maphash.Comparable(hashSeed, k)
	s := &c.shards[h%localShards]
	s.mu.Lock()
	defer s.mu.Unlock()
	if e := s.cur[h]; e != nil {
		return e
	}
	e := s.old[h]
	if e == nil && !create {
		return nil
	}
	if e == nil {
		e = &entry{}
	}
	if len(s.cur) >= c.max {
		s.old, s.cur = s.cur, make(map[uint64]*entry, c.max)
	}
	s.cur[h] = e
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
		if st.t != 0 && now >= st.t {
			st.left = float64(capacity(r))
			st.t = now + int64(period(r))
		}
		return
	}
	c := d.shareCap(r)
	if !st.init {
		st.init, st.left, st.t = true, c, now
		return
	}
	if now > st.t {
		st.left = min(c, st.left+float64(now-st.t)*d.shareRate(r))
		st.t = now
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
	owner := func(r *policy.Rule) *entry {
		if r.Scope == policy.ScopeTenant {
			return owners[0]
		}
		return owners[1]
	}
	// Each rule's index in its owner's states (-1: not enforced). Pointers
	// are taken per use: a later rule's state may move the earlier ones.
	var buf [8]int
	idx := buf[:0]
	if len(rules) > len(buf) {
		idx = make([]int, 0, len(rules))
	}
	idx = idx[:len(rules)]
	for i := range rules {
		idx[i] = -1
		r := &rules[i]
		out[i] = LimitState{Scope: r.Scope, Name: r.Name, Endpoint: r.Endpoint, Unit: r.Unit, Limit: capacity(r), Shadow: r.Shadow}
		if r.Kind == policy.Concurrency {
			out[i].Remaining = r.Limit.Limit // not enforced locally
			continue
		}
		if r.Kind == policy.Balance {
			out[i].Limit = 0
		}
		e := owner(r)
		idx[i] = e.index(stateID(r))
		st := e.at(idx[i])
		d.bring(r, st, now)
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
		if idx[i] < 0 {
			continue
		}
		r := &rules[i]
		e := owner(r)
		st := e.at(idx[i])
		need := float64(unitCost(r, cost))
		if denied < 0 && st.left >= need {
			st.left -= need
			*spends = append(*spends, localSpend{e: e, id: st.id, n: need, at: i})
		}
		left := int64(math.Floor(max(0, st.left)))
		out[i].Remaining = left
		if r.Kind == policy.Balance {
			out[i].Limit = left // credits unknown locally: report what is left
		} else {
			out[i].Used = max(0, int64(d.unspent(r, st))-left)
		}
		if quotaKind(r) && st.t > now {
			out[i].Reset = time.Duration(st.t - now)
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
		if st.t > now {
			return time.Duration(st.t - now), limits.ReasonNone
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
	id uint32
	n  float64
	at int // localCheck: the index of its rule; then its slot in Result.Limits
}

// remember records the remaining of the token limits of a subject and its
// tenant from a Redis decision, for local decisions during an outage.
func (d *Decider) remember(tenant, user string, states []limits.State, now int64) {
	d.rememberOf(ownerKey{scope: policy.ScopeUser, a: tenant, b: user}, false, states, now)
	d.rememberOf(ownerKey{scope: policy.ScopeTenant, a: tenant}, true, states, now)
}

// rememberOf records the quotas of one owner among states (the
// tenant-scope ones when tenant is set), under one lock of its entry.
func (d *Decider) rememberOf(k ownerKey, tenant bool, states []limits.State, now int64) {
	mine := func(r *policy.Rule) bool { return quotaKind(r) && (r.Scope == policy.ScopeTenant) == tenant }
	if !slices.ContainsFunc(states, func(s limits.State) bool { return mine(s.Rule) }) {
		return
	}
	e := d.local.get(k, true)
	e.mu.Lock()
	defer e.mu.Unlock()
	for i := range states {
		s := &states[i]
		r := s.Rule
		if !mine(r) {
			continue
		}
		var reset int64
		switch r.Kind {
		case policy.Balance:
		case policy.Rolling, policy.SlidingLog:
			reset = now + int64(time.Duration(r.Window))
		default: // fixed, calendar_month, token_bucket: Reset is when it is empty again
			reset = now + int64(s.Reset)
		}
		st := e.state(stateID(r))
		st.init, st.seen, st.left, st.t = true, true, float64(s.Remaining), reset
	}
}
