package decide

import (
	"math"
	"slices"
	"time"

	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
	"quotaflow/pkg/limits/repair"
)

// Local state: what the Decider knows without Redis, per owner (a subject, a
// tenant, an IP or an endpoint) and limit.
//
//   - Token limits of a subject or tenant (quotas, balances): the remaining
//     last seen in a Redis decision, spent down locally during an outage,
//     and back to the full limit once the window it was seen in has passed.
//     An owner never seen gets UnseenAllowance. What was allowed locally is
//     owed: Redis holds nothing of it until its actual usage is charged, so
//     each later Redis decision sets the remaining to Redis's less what is
//     owed (else every Redis answer between local decisions would give the
//     local allowance back). Owed spends are kept in two groups, the
//     current owedFor period's and the previous one's, and a group is
//     dropped when it falls out of both, so a spend stays owed at least
//     owedFor and at most twice that, never extended by later spends. A
//     window seen passing, of any kind, starts again at capacity less what
//     is owed: a fixed or calendar window's local end may come after
//     Redis's, so spends of the old window cannot be told from those of the
//     new. The table forgetting a state forgets what it owes too.
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

// ruleID identifies a limit across policy reloads as the engine's record
// does, by policy.Rule.ID (a limit whose size changes keeps its state, one
// whose kind, window or buckets change starts afresh, in Redis and here),
// and by its unit (above the ID's 48 bits), which the record's id leaves
// out. A rule Resolve returned keeps its ID, so a decision hashes nothing:
// hashing each rule's strings here was a third of remember's work
// (bench/results.md, "Admission's CPU per five-limit admit (session 15)").
func ruleID(r *policy.Rule) uint64 {
	var unit uint64
	if r.Unit == policy.Tokens {
		unit = 1
	}
	return uint64(r.ID()) | unit<<48
}

// stateID tells an owner's limit states apart: ruleID folded to 32 bits,
// never 0 (a free slot in localTable). Two limits of one owner collide with
// odds about n²/2³³ for its n limits (10⁻⁸ for ten); they would then share
// local state, which only matters while Redis is unavailable.
func stateID(r *policy.Rule) uint32 {
	h := ruleID(r)
	return max(1, uint32(h^h>>32))
}

// ruleState is the local state of one limit of one owner while it is
// decided; localTable keeps it packed (packedState).
type ruleState struct {
	left float64 // units still allowed locally
	// t is, for a quota, when the window seen frees everything (0: never;
	// kept in ms, Redis's own grain); for a share, its last refill.
	// Monotonic ns.
	t int64
	// owed is what a quota allowed locally that Redis may not hold yet:
	// owed[0] in owedFor period owedAt (now / owedFor modulo 2^owedBits),
	// owed[1] in the one before. float32 rounds: it is exact to 2²⁴ units a
	// group.
	owed   [2]float32
	owedAt uint32
	init   bool
	seen   bool // quota: left came from a Redis decision
}

// owing returns what st owes in all.
func (st *ruleState) owing() float64 { return float64(st.owed[0]) + float64(st.owed[1]) }

// owedBits is how many low bits of an owedFor period's number a state
// keeps (the table packs them beside a quota's reset in ms): periods are
// compared modulo 2^owedBits, so a state untouched for a multiple of that
// many periods (48 days of 1 s periods) keeps its debt once more, longer
// than needed, never shorter.
const (
	owedBits = 22
	owedMask = 1<<owedBits - 1
)

// rotateOwed moves st's owed groups to the owedFor period of now
// (monotonic ns): a group two periods old is owed no more.
func (st *ruleState) rotateOwed(owedFor time.Duration, now int64) {
	at := uint32(now/int64(owedFor)) & owedMask
	switch (at - st.owedAt) & owedMask {
	case 0:
	case 1:
		st.owed = [2]float32{0, st.owed[0]}
	default:
		st.owed = [2]float32{}
	}
	st.owedAt = at
}

// owedFor is how long a local spend of r may go unheld by Redis: until its
// actual usage is charged, which is within the reservation TTL, and never
// past r's period, after which no window counts it.
func (d *Decider) owedFor(r *policy.Rule) time.Duration {
	if p := period(r); p > 0 && p < d.ttl {
		return p
	}
	return d.ttl
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
// holds its bucket.
func (d *Decider) bring(r *policy.Rule, st *ruleState, now int64) {
	if quotaKind(r) {
		if !st.init {
			st.init, st.left = true, d.allowance(r)
		}
		st.rotateOwed(d.owedFor(r), now)
		if st.t != 0 && now >= st.t {
			// What is owed stays owed, whatever the kind: a fixed or
			// calendar boundary passes here up to a reply's latency (and a
			// ms) after Redis's, and spends in between are in Redis's new
			// window. Debts of the old window cost at most what they were,
			// until their group expires.
			st.left = float64(capacity(r)) - st.owing()
			st.t = d.nextReset(r, st.t, now)
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

// nextReset is when a quota's local window, which ended at t, ends again
// after now. A fixed or calendar window keeps Redis's boundaries (t is one):
// a window counted from the first local touch would end inside Redis's, and
// starting again at capacity there would forget what Redis counted before.
func (d *Decider) nextReset(r *policy.Rule, t, now int64) int64 {
	switch r.Kind {
	case policy.Fixed:
		p := int64(period(r))
		return t + ((now-t)/p+1)*p
	case policy.CalendarMonth:
		wall := d.epoch.Add(time.Duration(now))
		return int64(repair.BucketStart(r, repair.BucketOf(r, wall)+1).Sub(d.epoch))
	}
	return now + int64(period(r))
}

// localCheck decides rules locally for one request of cost: all-or-nothing,
// shadow limits never deny. owners[0] holds tenant-scope limits, owners[1]
// every other one (a single owner for shared layers may be given as both).
// Caller holds both owners' buckets (localTable.lock). It fills out (one
// state per rule) and returns the index of the first denying rule (-1:
// allowed), the wait and the reason. When allowed, the cost is spent and
// added to spends.
func (d *Decider) localCheck(owners [2]owner, rules []policy.Rule, cost int64, now int64, out []LimitState, spends *[]localSpend) (denied int, retry time.Duration, reason limits.Reason) {
	denied = -1
	ownerOf := func(r *policy.Rule) owner {
		if r.Scope == policy.ScopeTenant {
			return owners[0]
		}
		return owners[1]
	}
	// Each rule's state, loaded from a slot of the table (js: its index,
	// stored back below), or, past what its bucket holds, one not kept that
	// has nothing left (js: -1; nil: not enforced): a fresh state each
	// request would admit without limit, so such a limit denies locally.
	// The slots stay this decision's while the caller holds their buckets;
	// two rules of one slot (a stateID collision) share one state, as they
	// share the slot.
	var buf [8]ruleState
	var pbuf [8]*ruleState
	var jbuf [8]int
	vals, sts, js := buf[:], pbuf[:0], jbuf[:0]
	if len(rules) > len(buf) {
		vals, sts, js = make([]ruleState, len(rules)), make([]*ruleState, 0, len(rules)), make([]int, 0, len(rules))
	}
	sts, js = sts[:len(rules)], js[:len(rules)]
	for i := range rules {
		sts[i], js[i] = nil, -1
		r := &rules[i]
		out[i] = LimitState{Scope: r.Scope, Name: r.Name, Endpoint: r.Endpoint, Unit: r.Unit, Limit: capacity(r), Shadow: r.Shadow}
		if r.Kind == policy.Concurrency {
			out[i].Remaining = r.Limit.Limit // not enforced locally
			continue
		}
		if r.Kind == policy.Balance {
			out[i].Limit = 0
		}
		j, fresh := d.local.index(ownerOf(r), stateID(r))
		js[i], sts[i] = j, &vals[i]
		if k := slices.Index(js[:i], j); j >= 0 && k >= 0 {
			sts[i] = sts[k]
		} else if !fresh && j >= 0 {
			vals[i] = d.local.load(j, quotaKind(r))
		} else if j < 0 {
			vals[i] = ruleState{init: true}
			if !quotaKind(r) {
				vals[i].t = now // a share refills from now, by the time localWait gives
			}
		}
		st := sts[i]
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
		st := sts[i]
		if st == nil {
			continue
		}
		r := &rules[i]
		need := float64(unitCost(r, cost))
		if denied < 0 && st.left >= need {
			st.left -= need
			if quotaKind(r) {
				st.owed[0] += float32(need) // bring rotated it to now
			}
			if j := js[i]; j >= 0 {
				*spends = append(*spends, localSpend{o: ownerOf(r), slot: j, gen: d.local.gen(j), n: need, at: i, owedAt: st.owedAt, quota: quotaKind(r)})
			}
		}
		if js[i] >= 0 {
			d.local.store(js[i], quotaKind(r), st)
		}
		left := int64(math.Floor(max(0, st.left)))
		out[i].Remaining = left
		if r.Kind == policy.Balance {
			out[i].Limit = left // credits unknown locally: report what is left
		} else if js[i] >= 0 { // a state not kept has used nothing
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
	o    owner  // whose bucket holds the slot
	slot int    // the slot of the state it was taken from
	gen  uint32 // and its record's generation (localTable.gen)
	n    float64
	at   int // localCheck: the index of its rule; then its slot in Result.Limits
	// owedAt is the owed group a quota's spend went to (ruleState.owedAt).
	owedAt uint32
	quota  bool // the state is a quota's (quotaKind)
}

// giveBack returns a local spending to the state it was taken from, unless
// the table has forgotten that state since: a state of the same owner and
// limit created since started afresh without it. A spending given back is
// owed no more.
func (d *Decider) giveBack(s localSpend) {
	d.local.lock(s.o, owner{})
	if d.local.gen(s.slot) == s.gen {
		st := d.local.load(s.slot, s.quota)
		st.left += s.n
		// In the current group, or the previous one if a period began
		// since; older, it is owed no more already.
		if g := (st.owedAt - s.owedAt) & owedMask; s.quota && g < 2 {
			st.owed[g] = max(0, st.owed[g]-float32(s.n))
		}
		d.local.store(s.slot, s.quota, &st)
	}
	d.local.unlock(s.o, owner{})
}

// remember records the remaining of the token limits of a subject and its
// tenant from a Redis decision, for local decisions during an outage.
func (d *Decider) remember(tenant, user string, states []limits.State, now int64) {
	d.rememberOf(ownerKey{scope: policy.ScopeUser, a: tenant, b: user}, false, states, now)
	d.rememberOf(ownerKey{scope: policy.ScopeTenant, a: tenant}, true, states, now)
}

// rememberOf records the quotas of one owner among states (the
// tenant-scope ones when tenant is set), under one lock of its bucket, less
// what they owe (Redis does not hold it).
func (d *Decider) rememberOf(k ownerKey, tenant bool, states []limits.State, now int64) {
	mine := func(r *policy.Rule) bool { return quotaKind(r) && (r.Scope == policy.ScopeTenant) == tenant }
	if !slices.ContainsFunc(states, func(s limits.State) bool { return mine(s.Rule) }) {
		return
	}
	o := d.local.owner(k)
	d.local.lock(o, owner{})
	defer d.local.unlock(o, owner{})
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
		j, fresh := d.local.index(o, stateID(r))
		if j < 0 {
			return // more limits than a bucket holds: the rest are not kept, and deny locally
		}
		var st ruleState
		if !fresh {
			st = d.local.load(j, true)
		}
		d.bring(r, &st, now) // drops what is owed no more
		st.init, st.seen, st.left, st.t = true, true, float64(s.Remaining)-st.owing(), reset
		d.local.store(j, true, &st)
	}
}
