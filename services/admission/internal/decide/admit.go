package decide

import (
	"context"
	"errors"
	"slices"
	"time"

	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
)

// Admit decides one request: it resolves the policy, checks the layers in
// order (IP, global, then tenant and user in one Redis call), reserves the
// cost in all of them or none, and reports every limit it checked. A denial
// is a Result, not an error. Errors are the caller's: an Input field
// (matches limits.ErrInvalid, reads "<field>: <what is wrong>") or an
// unknown plan (matches policy.ErrUnknownPlan); a failing Redis never makes
// Admit fail (see the package documentation).
func (d *Decider) Admit(ctx context.Context, in Input) (Result, error) {
	if err := in.validate(); err != nil {
		return Result{}, err
	}
	rs, err := d.resolve(in.Tenant, in.Plan, in.Endpoint)
	if err != nil {
		return Result{}, err
	}
	a := admission{d: d, ctx: ctx, in: in, remote: true}
	if deg, _, outage, noEpoch := d.br.status(); deg && !noEpoch && d.failOpen(outage) {
		a.allowAll(rs.Plan)
	} else if err := a.run(&rs); err != nil {
		return Result{}, err
	}
	d.m.decision(rs.Endpoint, &a.res)
	a.res.Rules = rs
	return a.res, nil
}

// admission is the state of one Admit.
type admission struct {
	d   *Decider
	ctx context.Context
	in  Input // by value: a pointer to Admit's copy would move it to the heap

	// remote is cleared once a Redis call of this admission failed or was
	// refused by the breaker: the remaining layers are decided locally
	// without waiting on Redis again.
	remote bool
	// res.Limits has a slot per rule of every layer reached, left zero when
	// its rule was not checked; run compacts it at the end, so that the
	// slots stay put until undo has re-reported what it gave back.
	res    Result
	denied int // index in res.Limits of the denying limit, -1 if none
	// reused is a denial by no limit: the request id is taken and the
	// request wanted a fresh one (Input.Fresh).
	reused bool

	// What earlier layers took, to give back on a later denial, each with
	// the slot in res.Limits of the limit it took from.
	takes  []leaseTake  // leased units
	spends []localSpend // local shares and quotas
	shared []sharedRes  // reservations in Redis
}

// leaseTake is a unit spent from a lease.
type leaseTake struct {
	h  *held
	at int
}

// sharedRes is a shared reservation made in Redis; rules[j] is reported in
// slot at+idx[j].
type sharedRes struct {
	scope   policy.Scope
	tenant  string // the counters' slot (Charge.Tenant)
	id      string
	cost    int64
	rules   []policy.Rule
	at      int
	idx     []int
	counted bool      // in CountBatch's counters (Check), not the shared blob
	now     time.Time // the decision's Redis time, which dates its give back
}

// allowAll is the decision past FailOpenAfter: everything is allowed and
// nothing is checked.
func (a *admission) allowAll(plan string) {
	now := time.Now()
	a.res = Result{Allowed: true, Local: true, Plan: plan, Now: now, ExpiresAt: now.Add(a.d.ttl)}
	v := voidOf(&a.in, plan)
	v.Allowed = true
	a.d.voids.add(v) // the request keeps its id (see subjectLayer)
}

func (a *admission) run(rs *policy.Resolved) error {
	a.denied = -1
	a.res = Result{Plan: rs.Plan}
	if n := len(rs.IP) + len(rs.Global) + len(rs.Subject); a.in.Room != nil && n <= RoomLimits {
		a.res.Limits = a.in.Room[:0]
	} else {
		a.res.Limits = make([]LimitState, 0, n)
	}
	ok := true
	var err error
	if a.in.IP != "" && len(rs.IP) > 0 {
		ok, err = a.sharedLayer(policy.ScopeIP, a.in.IP, rs.IP)
	}
	if ok && err == nil && len(rs.Global) > 0 {
		ok, err = a.sharedLayer(policy.ScopeGlobal, rs.Endpoint, rs.Global)
	}
	if !ok && err == nil && a.in.CallerID && !a.in.Fresh && limits.KeepsRecord(rs.Subject) && a.retryOfAdmitted() {
		// A retry of an admitted request gets its stored decision, not a
		// denial by a layer it passed when it was admitted. A plan without
		// records has no stored decision: any record of the id (a void's, a
		// settled actual's) would let every repeat skip these layers.
		a.undo()
		a.denied, a.res.RetryAfter, a.res.Reason = -1, 0, limits.ReasonNone
		a.res.Limits = a.res.Limits[:0]
		ok = true
	}
	if ok && err == nil {
		ok, err = a.subjectLayer(rs.Subject, rs.Counted)
	}
	if err != nil {
		a.undo()
		return err
	}
	if !ok {
		a.undo()
	}
	a.res.Limits = compact(a.res.Limits, &a.denied)
	if a.res.Now.IsZero() {
		a.res.Now = time.Now()
	}
	a.res.ExpiresAt = a.res.Now.Add(a.d.ttl)
	a.res.Allowed = a.denied < 0 && !a.reused
	if a.denied >= 0 {
		a.res.DeniedBy = &a.res.Limits[a.denied]
	}
	for i := range a.res.Limits {
		if a.res.Limits[i].WouldDeny {
			a.res.ShadowDenied = true
			break
		}
	}
	return nil
}

// retryOfAdmitted reports whether the request id already has a reservation
// in Redis; false when Redis cannot say, or while the id's reserve is not
// sent (voider.waits): Admitted may answer true (for a request admitted
// before its tenant's slot moved, or a lost call that ran), the shared
// layers' denial would be skipped, and the retry, its reserve not sent,
// allowed locally: admitted a second time. The breaker first, as in
// reserve: while it is open voids pile up, and waits would take their lock
// for a call not sent anyway (a denial by a lease known exhausted leaves
// remote set).
func (a *admission) retryOfAdmitted() bool {
	if !a.remote || !a.d.br.allow() || a.d.voids.waits(a.in.Tenant, a.in.User, a.in.RequestID) {
		return false
	}
	var admitted bool
	err := a.d.callFor(a.ctx, a.in.Tenant, opReserve, func(ctx context.Context) error {
		var err error
		admitted, err = a.d.lim.Admitted(ctx, a.in.Tenant, a.in.User, a.in.RequestID)
		return err
	})
	return err == nil && admitted
}

// deny records the first denial.
func (a *admission) deny(i int, retry time.Duration, reason limits.Reason) {
	a.denied, a.res.RetryAfter, a.res.Reason = i, retry, reason
}

// sharedLayer checks the IP or the global layer: leasable limits from local
// leases, the others in one ReserveShared call (or locally when Redis is
// unavailable). It reports whether the layer allowed.
func (a *admission) sharedLayer(scope policy.Scope, id string, rules []policy.Rule) (bool, error) {
	d := a.d
	base := len(a.res.Limits)
	a.res.Limits = a.res.Limits[:base+len(rules)]
	states := a.res.Limits[base:]
	// A slot left zero was not checked (after a retry's reset it held the
	// states of the first pass).
	clear(states)
	var rest, local []int // rule indexes for ReserveShared, for local shares

	now := d.mono()
	for i := range rules {
		r := &rules[i]
		var p *pool
		if limits.Leasable(r) {
			p = d.poolFor(scope, id, r)
		}
		if p == nil {
			rest = append(rest, i)
			continue
		}
		var sr spendResult
		if a.remote {
			sr = d.spend(a.ctx, p, now)
		} else if h := p.take(now); h != nil {
			sr.h = h
		} else {
			sr.err = errBreakerOpen
		}
		switch {
		case sr.h != nil:
			a.takes = append(a.takes, leaseTake{h: sr.h, at: base + i})
			states[i] = d.leasedState(p, r, now, false)
		case sr.err != nil:
			a.remote = false
			local = append(local, i)
		case sr.contended:
			rest = append(rest, i)
		default: // exhausted
			states[i] = d.leasedState(p, r, now, true)
			if r.Shadow {
				states[i].WouldDeny = true
				continue
			}
			a.deny(base+i, sr.retry, limits.ReasonNone)
			return false, nil
		}
	}

	if len(rest) > 0 && a.remote {
		sub := rules
		if len(rest) < len(rules) {
			sub = make([]policy.Rule, len(rest))
			for j, i := range rest {
				sub[j] = rules[i]
			}
		}
		var dec limits.Decision
		err := d.call(a.ctx, opReserveShared, func(ctx context.Context) error {
			var err error
			dec, err = d.lim.ReserveShared(ctx, scope, id, a.in.Cost, sub)
			return err
		})
		switch {
		case err == nil:
			for j, i := range rest {
				states[i] = stateOf(&dec.States[j])
			}
			if !dec.Allowed {
				a.deny(base+rest[max(0, dec.DeniedBy)], dec.RetryAfter, dec.Reason)
				return false, nil
			}
			a.shared = append(a.shared, sharedRes{scope: scope, id: id, cost: a.in.Cost, rules: sub, at: base, idx: rest, now: dec.Now})
			rest = nil
		case errors.Is(err, limits.ErrInvalid):
			return false, err
		default:
			a.remote = false
		}
	}
	local = append(local, rest...)
	if len(local) == 0 {
		return true, nil
	}
	slices.Sort(local)
	sub := make([]policy.Rule, len(local))
	for j, i := range local {
		sub[j] = rules[i]
	}
	out := make([]LimitState, len(sub))
	o := d.local.owner(ownerKey{scope: scope, a: id})
	n := len(a.spends)
	d.local.lock(o, owner{})
	di, retry, reason := d.localCheck([2]owner{o, o}, sub, a.in.Cost, d.mono(), out, &a.spends)
	d.local.unlock(o, owner{})
	for k := n; k < len(a.spends); k++ {
		a.spends[k].at = base + local[a.spends[k].at]
	}
	a.res.Local = true
	for j, i := range local {
		states[i] = out[j]
	}
	if di >= 0 {
		a.deny(base+local[di], retry, reason)
		return false, nil
	}
	return true, nil
}

// compact drops the slots of rules that were not checked (zero: no scope),
// keeping order, and moves the denied index with them.
func compact(ls []LimitState, denied *int) []LimitState {
	n := 0
	for i := range ls {
		if ls[i].Scope == "" {
			continue
		}
		if *denied == i {
			*denied = n
		}
		ls[n] = ls[i]
		n++
	}
	return ls[:n]
}

// subjectLayer checks the tenant-wide and user limits: one Reserve call, or
// locally when Redis is unavailable; in counters when counted
// (policy.Resolved.Counted).
func (a *admission) subjectLayer(rules []policy.Rule, counted bool) (bool, error) {
	d := a.d
	base := len(a.res.Limits)
	a.res.Limits = a.res.Limits[:base+len(rules)]
	states := a.res.Limits[base:]
	in := &a.in
	// Once a decision is taken without Redis, Redis is made to agree with
	// it (voider): a request allowed locally keeps its id, so a retry is a
	// duplicate there too; a Reserve that may have run though its reply
	// never came (lost) is undone, whatever was decided.
	lost := voidOf(in, a.res.Plan)
	if a.remote {
		req := limits.Request{Tenant: in.Tenant, User: in.User, RequestID: in.RequestID, Cost: in.Cost, Rules: rules,
			Fingerprint: lost.Fingerprint, Nonce: newNonce(), Fresh: in.Fresh, Counted: counted}
		dec, sent, err := d.reserve(a.ctx, req)
		switch {
		case err == nil:
			for i := range dec.States {
				states[i] = stateOf(&dec.States[i])
			}
			d.remember(in.Tenant, in.User, dec.States, d.mono())
			a.res.Now, a.res.Version, a.res.TenantVersion = dec.Now, dec.Version, dec.TenantVersion
			switch {
			case dec.Duplicate:
				// Admitted before: the earlier layers were counted then.
				a.res.Duplicate = true
				a.undo()
				return true, nil
			case dec.Conflict == limits.ConflictReused:
				a.reused, a.res.Reason = true, limits.ReasonRequestIDReused
				return false, nil
			case dec.Conflict != limits.NoConflict:
				return false, conflictError(dec.Conflict)
			case !dec.Allowed:
				a.deny(base+max(0, dec.DeniedBy), dec.RetryAfter, dec.Reason)
				return false, nil
			}
			return true, nil
		case errors.Is(err, limits.ErrInvalid):
			return false, err
		case sent && mayHaveRun(err):
			lost.Nonce = req.Nonce
		}
		a.remote = false
	}
	var te owner // none unless a rule is tenant-wide
	ue := d.local.owner(ownerKey{scope: policy.ScopeUser, a: in.Tenant, b: in.User})
	for i := range rules {
		if rules[i].Scope == policy.ScopeTenant {
			te = d.local.owner(ownerKey{scope: policy.ScopeTenant, a: in.Tenant})
			break
		}
	}
	n := len(a.spends)
	d.local.lock(ue, te)
	di, retry, reason := d.localCheck([2]owner{te, ue}, rules, in.Cost, d.mono(), states, &a.spends)
	d.local.unlock(ue, te)
	for k := n; k < len(a.spends); k++ {
		a.spends[k].at += base
	}
	a.res.Local = true
	// A plan without records has nothing for a void to mark or undo:
	// reserve.lua and count.lua read no record for it, so a void would
	// only leave an unread key for a day.
	if lost.Allowed = di < 0; (lost.Allowed || lost.Nonce != 0) && limits.KeepsRecord(rules) {
		d.voids.add(lost)
	}
	if di >= 0 {
		a.deny(base+di, retry, reason)
		return false, nil
	}
	return true, nil
}

// undo gives back what the layers checked so far took: leased units and
// local spending at once, shared Redis reservations with a compensating
// ChargeShared (best effort: skipped while the breaker is open, and then
// the reservation stays counted until its window passes, an
// under-admission).
// The limits it gave back to are reported without what they got back
// (docs/design.md §4: used and remaining are after the decision).
func (a *admission) undo() {
	for _, t := range a.takes {
		t.h.left.Add(1)
		a.givenBack(t.at, 1)
	}
	for _, s := range a.spends {
		a.d.giveBack(s)
		a.givenBack(s.at, int64(s.n))
	}
	a.takes, a.spends = nil, nil
	for _, s := range a.shared {
		if !a.d.compensate(a.ctx, s, s.cost) {
			continue
		}
		for j := range s.rules {
			a.givenBack(s.at+s.idx[j], unitCost(&s.rules[j], s.cost))
		}
	}
	a.shared = nil
}

// givenBack re-reports the limit in slot i after n of its units were given
// back: n less used, n more remaining, but never more than the limit leaves
// (a window Redis counts past its limit has nothing remaining). Remaining
// is not Limit - Used throughout: a local share reports what this instance
// may still allow.
func (a *admission) givenBack(i int, n int64) {
	s := &a.res.Limits[i]
	s.Used = max(0, s.Used-n)
	s.Remaining = min(s.Remaining+n, max(0, s.Limit-s.Used))
}

// compensate gives back a shared reservation of cost; false when Redis
// could not be told, so the reservation still counts.
func (d *Decider) compensate(ctx context.Context, s sharedRes, cost int64) bool {
	// ChargeShared moves request limits by 1 in the amount's direction and
	// token limits by the amount; a cost of 0 took nothing from token limits.
	rules, amount := s.rules, -cost
	if cost == 0 {
		rules = nil
		for i := range s.rules {
			if s.rules[i].Unit == policy.Requests {
				rules = append(rules, s.rules[i])
			}
		}
		amount = -1
	}
	if len(rules) == 0 {
		return true
	}
	if _, err := d.chargeShared(ctx, s.counted, s.scope, s.tenant, s.id, rules, amount, s.now); err != nil {
		d.log.Debug("compensate shared reservation", "scope", string(s.scope), "err", err)
		return false
	}
	return true
}
