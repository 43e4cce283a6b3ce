package limits

import (
	"context"
	"errors"
	"fmt"
	"time"

	"quotaflow/pkg/limits/internal/script"
	"quotaflow/pkg/limits/internal/wire"
	"quotaflow/pkg/limits/policy"
)

// CountBatch decides groups of fixed-window counters, each group all or
// nothing, and returns one outcome per group, in order: what the groups
// would have got one after another (with one Redis time for all). Each
// SharedRequest of a group adds its Cost (1 to a requests rule) to one
// counter per rule, which must be a policy.Fixed window; a counter is the
// rule's window of the request's Scope (policy.ScopeGlobal or
// policy.ScopeIP) and ID. The group is allowed when every counter that is
// not shadow fits (its count plus cost within its limit), checked in order
// after what the group's earlier counters would add; then every counter is
// charged, shadow ones included, else none is.
//
// It is the final charge ShouldRateLimit wants, cheaper in Redis than
// ReserveShared: each counter is a key of its own ('<i6i6' window number
// and count, expiring with its window; count.lua), not a record in the
// scope's blob, so the two never share a count. Nothing keeps a
// reservation; a group's charge is not given back later.
//
// A Decision's States hold one state per rule of each request, in order,
// as they are after the decision (a denied group's as they were); DeniedBy
// indexes them. The groups go out in one script call per wire.MaxBatch
// groups; on a Redis Cluster or Ring a group's counters of each hash slot
// go in that slot's call, and when one slot's part is denied (or fails)
// what the others took is given back in a second round trip, so the
// groups after it in the batch may have seen that charge. The give back is
// not cancelled with ctx and has as long as ctx had left when CountBatch
// began; a group whose give back failed says so in GiveBack. An invalid
// group fails alone with ErrInvalid; a group whose slot lost its epoch
// gets ErrNoEpoch.
func (l *Limiter) CountBatch(ctx context.Context, groups [][]SharedRequest) []Reserved {
	out := make([]Reserved, len(groups))
	end, timed := ctx.Deadline()
	budget := time.Until(end)
	// One part per group unless slot bound: sized once, as are counters.
	parts := make([]countPart, 0, len(groups))
	bySlot := l.run.SlotBound()
	for g, reqs := range groups {
		n := countersOf(reqs)
		if n > MaxCounters {
			out[g].Err = fmt.Errorf("%w: count: %d counters in a group, more than %d", ErrInvalid, n, MaxCounters)
			continue
		}
		cs := make([]wire.Counter, 0, n)
		for i := range reqs {
			r := &reqs[i]
			for j := range r.Rules {
				c := wire.Counter{Scope: r.Scope, Tenant: r.Tenant, ID: r.ID, Cost: r.Cost, Rule: &r.Rules[j]}
				if r.Rules[j].Unit != policy.Tokens {
					c.Cost = 1
				}
				if err := wire.CheckCounter(&c); err != nil {
					out[g].Err = fmt.Errorf("count %s %s: %w", r.Scope, r.ID, err)
					cs = nil
					break
				}
				cs = append(cs, c)
			}
			if out[g].Err != nil {
				break
			}
		}
		if out[g].Err != nil {
			continue
		}
		if len(cs) == 0 {
			out[g].Decision = Decision{Allowed: true, DeniedBy: -1, States: []State{}}
			continue
		}
		out[g].Decision.States = make([]State, len(cs))
		if !bySlot {
			parts = append(parts, countPart{group: g, counters: cs})
			continue
		}
		first := len(parts)
		for i := range cs {
			slot := cs[i].Slot()
			k := first
			for k < len(parts) && parts[k].slot != slot {
				k++
			}
			if k == len(parts) {
				parts = append(parts, countPart{group: g, slot: slot})
			}
			parts[k].counters = append(parts[k].counters, cs[i])
			parts[k].at = append(parts[k].at, i)
		}
	}
	done := l.runCounts(ctx, parts)
	// A group is allowed when every part is; a part that took its charge
	// while another part of its group did not gives it back.
	failed := make([]error, len(groups))
	denied := make([]bool, len(groups))
	for k := range parts {
		p := &parts[k]
		if done[k].err != nil && failed[p.group] == nil {
			failed[p.group] = done[k].err
		}
		if done[k].err == nil && done[k].Status != wire.StatusAllowed {
			denied[p.group] = true
		}
	}
	var back []countPart
	for k := range parts {
		p := &parts[k]
		if (failed[p.group] != nil || denied[p.group]) && done[k].err == nil && done[k].Status == wire.StatusAllowed {
			neg := make([]wire.Counter, len(p.counters))
			for i, c := range p.counters {
				c.Cost = -c.Cost
				neg[i] = c
			}
			back = append(back, countPart{group: p.group, slot: p.slot, counters: neg, back: done[k].now.UnixMilli()})
		}
	}
	if len(back) > 0 {
		// The decision is made: its give back must not die with a caller
		// that left or a deadline the decision spent.
		bctx := context.WithoutCancel(ctx)
		if timed {
			var cancel context.CancelFunc
			bctx, cancel = context.WithTimeout(bctx, budget)
			defer cancel()
		}
		for k, d := range l.runCounts(bctx, back) {
			if g := back[k].group; d.err != nil && out[g].GiveBack == nil {
				out[g].GiveBack = fmt.Errorf("count: give back: %w", d.err)
			}
		}
	}
	for g := range groups {
		if out[g].Err == nil && failed[g] != nil {
			out[g].Err = failed[g]
		}
		if out[g].Err == nil {
			out[g].Decision.Allowed, out[g].Decision.DeniedBy = !denied[g], -1
		}
	}
	for k := range parts {
		if p := &parts[k]; out[p.group].Err == nil {
			out[p.group].Decision.count(p, &done[k])
		}
	}
	return out
}

// count fills the states of part p's counters from its outcome r, and the
// denial they make, in d (Allowed set, DeniedBy -1 or an earlier part's).
func (d *Decision) count(p *countPart, r *counted) {
	if d.Now.IsZero() {
		d.Now = r.now
	}
	for i, c := range p.counters {
		at := p.index(i)
		s := &d.States[at]
		seen := r.Seen[i]
		fits := seen+c.Cost <= c.Rule.Limit.Limit
		used := seen
		if d.Allowed {
			used = min(seen+c.Cost, MaxCost)
		}
		*s = counterState(&c, used, r.now)
		s.WouldDeny = !fits && c.Rule.Shadow
		if !fits && !c.Rule.Shadow && (d.DeniedBy < 0 || at < d.DeniedBy) {
			d.DeniedBy, d.RetryAfter, d.Reason = at, s.Reset, ReasonNone
			if c.Cost > c.Rule.Limit.Limit {
				d.RetryAfter, d.Reason = 0, ReasonCostExceedsLimit
			}
		}
	}
}

// MaxCounters is the most counters (a SharedRequest's rules, summed over
// the group) one CountBatch group or AdjustCount call may have: a group
// goes out in one script call, whose keys are bounded
// (wire.MaxCountKeys), and ShouldRateLimit's 64 descriptors need far fewer.
const MaxCounters = 1024

// countersOf is the number of counters of group reqs.
func countersOf(reqs []SharedRequest) int {
	n := 0
	for i := range reqs {
		n += len(reqs[i].Rules)
	}
	return n
}

// countPart is the counters of one group in one script call: all of them,
// or on a slot-bound client those of one hash slot; at gives each one's
// index among the group's (nil: all of them, in order). back, when set, makes it an adjustment by the
// counters' (negative) costs dated then (Unix ms): a give back.
type countPart struct {
	group    int
	slot     uint16
	counters []wire.Counter
	at       []int
	back     int64
}

// counted is the outcome of one countPart: its reply or error, the Redis
// time of its call (µs) and its place among the call's groups.
type counted struct {
	wire.CountReply
	err   error
	now   time.Time
	place int
}

// runCounts sends parts in one round trip, one script call per slot and
// wire.MaxBatch parts, and returns each part's outcome.
func (l *Limiter) runCounts(ctx context.Context, parts []countPart) []counted {
	done := make([]counted, len(parts))
	groups := batches(l, len(parts), func(i int) uint16 { return parts[i].slot },
		func(i int) int { return 2 * len(parts[i].counters) }, l.p.NewCountBatch,
		func(b *wire.CountBatch, i int) error {
			b.Add(parts[i].back, parts[i].counters)
			return nil
		})
	calls := groupCalls(groups)
	cmds := l.run.RunAll(ctx, script.Count, calls)
	for k := range calls {
		which := groups[k].which
		now := wire.DecodeCount(cmds[k], groups[k].batch, func(j int, v wire.CountReply, err error) {
			done[which[j]] = counted{CountReply: v, err: err, place: j}
		})
		for _, j := range which {
			done[j].now = now
		}
	}
	return done
}

// index is the index of p's counter i among its group's.
func (p *countPart) index(i int) int {
	if p.at == nil {
		return i
	}
	return p.at[i]
}

// AdjustCount adds amount (negative: gives back) to the CountBatch counters
// of rules (fixed windows) of scope's id, kept in tenant's slot when tenant
// is set (SharedRequest.Tenant), in their current windows, as
// ChargeShared does to the shared blob: never refused by a limit, held to
// 0 to MaxCost; a requests rule moves by 1 in amount's direction. It is a
// correction of what an earlier CountBatch charged: dated at (that
// decision's Decision.Now), it leaves alone a counter whose window has
// ended since, which no longer holds that charge; a zero at is Redis's
// now. It returns the counters after it, and ErrNoEpoch when Redis lost
// its data.
func (l *Limiter) AdjustCount(ctx context.Context, scope policy.Scope, tenant, id string, rules []policy.Rule, amount int64, at time.Time) ([]State, error) {
	if amount < -MaxCost || amount > MaxCost {
		return nil, fmt.Errorf("%w: adjust %s %s: amount %d: want -%d to %d", ErrInvalid, scope, id, amount, int64(MaxCost), int64(MaxCost))
	}
	if len(rules) > MaxCounters {
		return nil, fmt.Errorf("%w: adjust %s %s: %d rules, more than %d", ErrInvalid, scope, id, len(rules), MaxCounters)
	}
	cs := make([]wire.Counter, len(rules))
	for i := range rules {
		c := wire.Counter{Scope: scope, Tenant: tenant, ID: id, Cost: max(amount, -amount), Rule: &rules[i]}
		if rules[i].Unit != policy.Tokens {
			c.Cost = 1
		}
		if err := wire.CheckCounter(&c); err != nil {
			return nil, fmt.Errorf("adjust %s %s: %w", scope, id, err)
		}
		if amount < 0 {
			c.Cost = -c.Cost
		}
		cs[i] = c
	}
	date := int64(wire.AdjustNow)
	if !at.IsZero() {
		date = at.UnixMilli()
		if date <= 0 || date >= 1<<47 { // an i6 on the wire: beyond, it would wrap negative, which count.lua takes for now
			return nil, fmt.Errorf("%w: adjust %s %s: date %v: want after 1970 and before 2^47 ms", ErrInvalid, scope, id, at)
		}
	}
	b := l.p.NewCountBatch()
	b.Add(date, cs)
	c := b.Call()
	var after []int64
	var err error
	now := wire.DecodeCount(l.run.Run(ctx, script.Count, &c), b, func(_ int, v wire.CountReply, e error) {
		after, err = v.Seen, e
	})
	if err != nil {
		if !errors.Is(err, ErrNoEpoch) {
			err = fmt.Errorf("adjust %s %s: %w", scope, id, err)
		}
		return nil, err
	}
	out := make([]State, len(cs))
	for i := range cs {
		out[i] = counterState(&cs[i], after[i], now)
	}
	return out, nil
}

// counterState is the State of counter c holding used at Redis time now.
func counterState(c *wire.Counter, used int64, now time.Time) State {
	lim := c.Rule.Limit.Limit
	return State{Rule: c.Rule, Limit: lim, Used: used, Remaining: max(0, lim-used), Reset: windowLeft(c.Rule, now)}
}

// windowLeft is the time from now to the end of fixed window r's current
// window.
func windowLeft(r *policy.Rule, now time.Time) time.Duration {
	w, ms := time.Duration(r.Window).Milliseconds(), now.UnixMilli()
	return time.Duration((ms/w+1)*w-ms) * time.Millisecond
}
