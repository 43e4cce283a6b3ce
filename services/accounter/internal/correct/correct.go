// Package correct applies the accounter's effects to Redis through
// pkg/limits: an actual event corrects its reservation's token windows, a
// released event gives the estimate back, expired reservations are settled,
// after Redis lost its data every subject active in the longest window is
// rebuilt from the ledger before the epoch key is written, and a periodic
// reconciliation (Reconciler) repairs windows that drifted from the ledger.
package correct

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/pkg/events"
	"quotaflow/pkg/limits"
	"quotaflow/services/accounter/internal/ledger"
)

// Ledger is what the Corrector reads from Postgres to rebuild Redis.
type Ledger interface {
	UsageSince(ctx context.Context, since time.Time, f func(ledger.Usage) error) error
	RecentSince(ctx context.Context, now time.Time, ttl time.Duration, f func(ledger.Recent) error) error
	Balances(ctx context.Context, f func(ledger.Balance) error) error
	TryLock(ctx context.Context, id int64) (unlock func(), ok bool, err error)
	MarkRebuild(ctx context.Context, epoch string) error
}

// ErrResolve wraps the errors of resolving an event's rules from the
// policy: a problem of the event or the policy, not an outage.
var ErrResolve = errors.New("resolve rules")

// rebuildLockID is the Postgres advisory lock the accounter's instances
// take around a rebuild, so that only one of them charges the ledger into
// Redis ("qf-rebuild" as a number).
const rebuildLockID = 0x71662d7265627569

// Corrector applies events to Redis. Its methods are safe for concurrent
// use; create it with New.
//
// Consumers hold Gate's read lock from before a batch's ledger write
// until the ledger records that Redis holds its effects, and Rebuild holds
// the write lock, so a rebuild never reads a ledger that is behind Redis within this
// process.
type Corrector struct {
	lim    *limits.Limiter
	rdb    redis.UniversalClient
	policy func() *limits.Policy
	store  Ledger
	log    *slog.Logger

	// Gate orders batches against rebuilds; see the type's doc.
	Gate sync.RWMutex
}

// New returns a Corrector using lim (over rdb) with the current policy
// from policy, rebuilding from store.
func New(lim *limits.Limiter, rdb redis.UniversalClient, policy func() *limits.Policy, store Ledger, log *slog.Logger) *Corrector {
	return &Corrector{lim: lim, rdb: rdb, policy: policy, store: store, log: log.With("component", "correct")}
}

// Cost is the weighted cost of an actual event under the current policy,
// saturated at limits.MaxCost as the counters are: usage that large is
// charged as the most a window can hold, never refused.
func (c *Corrector) Cost(d events.Actual) int64 {
	return min(c.policy().Cost(d.Model, d.InputTokens, d.OutputTokens), limits.MaxCost)
}

// rules returns the subject rules of tenant on plan for endpoint under
// the current policy; see subjectRules.
func (c *Corrector) rules(tenant, plan, endpoint string) ([]limits.Rule, error) {
	return subjectRules(c.policy(), tenant, plan, endpoint)
}

// subjectRules returns the subject rules of tenant on plan for endpoint
// under p; a plan p no longer has falls back to the tenant's or default
// plan.
func subjectRules(p *limits.Policy, tenant, plan, endpoint string) ([]limits.Rule, error) {
	r, err := p.Resolve(tenant, plan, endpoint)
	if errors.Is(err, limits.ErrUnknownPlan) {
		r, err = p.Resolve(tenant, "", endpoint)
	}
	if err != nil {
		return nil, fmt.Errorf("%w of %s: %w", ErrResolve, tenant, err)
	}
	return r.Subject, nil
}

// Effect is the Redis effect of one event: the correction of a reservation
// to the actual Cost, or its release (Release). Row is the reservation's
// ledger row (after the batch's write); its estimate and time are the
// fallback when Redis holds no record, and with no estimate anywhere an
// actual is charged in full at the row's time.
type Effect struct {
	Release bool
	// IfGone makes a release apply only where Redis holds no record of the
	// request id (admission's release found none: see limits.SettleOp).
	IfGone bool
	Cost   int64
	// Endpoint is the actual's, for rules when the row has none.
	Endpoint string
	Row      ledger.Reservation
}

// Outcome is what became of one Effect. OK is false when there was nothing
// to do: an actual of a reservation the ledger already settled at its
// estimate (expired) is not applied.
type Outcome struct {
	Settlement limits.Settlement
	OK         bool
	Err        error
}

// Apply applies effects to Redis in one pipelined round trip
// (limits.SettleMany), in order, and returns one outcome per effect; an
// effect's failure (its rules unresolvable, Redis unreachable) fails only
// its own outcome.
func (c *Corrector) Apply(ctx context.Context, effects []Effect) []Outcome {
	out := make([]Outcome, len(effects))
	ops := make([]limits.SettleOp, 0, len(effects))
	owner := make([]int, 0, len(effects)) // effects index of each op
	for i, e := range effects {
		res := e.Row
		op := limits.SettleOp{Release: e.Release, IfGone: e.IfGone}
		endpoint := cmp.Or(res.Endpoint, e.Endpoint)
		if !e.Release {
			if res.Status == ledger.StatusExpired || res.Status == ledger.StatusExpiredReleased {
				continue
			}
			op.Actual = e.Cost
		}
		rules, err := c.rules(res.Tenant, res.Plan, endpoint)
		if err != nil {
			out[i].Err = err
			continue
		}
		op.Tenant, op.User, op.RequestID = res.Tenant, res.User, res.RequestID
		op.Rules, op.Fallback = rules, fallback(res)
		ops = append(ops, op)
		owner = append(owner, i)
	}
	for j, r := range c.lim.SettleMany(ctx, ops) {
		out[owner[j]] = Outcome{Settlement: r.Settlement, OK: r.Err == nil, Err: r.Err}
	}
	return out
}

// fallback is what Redis holds for reservation res when it has no record
// of it: its estimate at its time while it is open, nothing once it was
// released (an actual then is charged in full), and nothing when there is
// no estimate or the decision was made without Redis (then an actual is
// charged in full at the row's time, where a rebuild counts it too, and a
// release gives nothing back).
func fallback(res ledger.Reservation) *limits.Fallback {
	switch {
	case res.Estimate < 0 || res.ReservedAt.IsZero() || res.Local:
		return &limits.Fallback{ReservedAt: res.At, Estimate: limits.NoEstimate}
	case res.Status == ledger.StatusReleased:
		return &limits.Fallback{ReservedAt: res.ReservedAt, Estimate: 0}
	}
	return &limits.Fallback{ReservedAt: res.ReservedAt, Estimate: res.Estimate}
}

// CorrectedEvent is the corrected event of settlement s of request
// requestID of (tenant, user), with the touched limits after it.
func CorrectedEvent(source, tenant, user, requestID string, s limits.Settlement, delta int64, now time.Time) events.Event {
	ls := make([]events.LimitState, 0, len(s.States))
	for _, st := range s.States {
		if st.Rule == nil {
			continue
		}
		ls = append(ls, events.LimitState{
			Scope: string(st.Rule.Scope), Name: st.Rule.Name, Endpoint: st.Rule.Endpoint,
			Unit: string(st.Rule.Unit), Limit: st.Limit, Used: st.Used, Remaining: st.Remaining,
			ResetSeconds: int64((st.Reset + time.Second - 1) / time.Second),
		})
	}
	return events.NewCorrected(source, events.Corrected{
		RequestID: requestID, Tenant: tenant, User: user, Delta: delta,
		Version: s.Version, TenantVersion: s.TenantVersion, Limits: ls,
	}, now)
}

// EnsureEpoch rebuilds Redis from the ledger when epoch keys are missing
// (a restart without persistence, a flush, a failover to an empty replica)
// and then writes the epoch, so admission leaves its local mode. It returns
// whether it rebuilt. Only the slots that lost their epoch are rebuilt (a
// cluster loses a shard at a time; the others keep their state), and what
// an earlier, unfinished attempt put in them is cleared first, so a rebuild
// retried after a failure charges each window once. Only one instance
// rebuilds at a time (a Postgres advisory lock); the others find the epoch
// written on their next check.
func (c *Corrector) EnsureEpoch(ctx context.Context) (rebuilt bool, subjects int, err error) {
	lost, err := limits.LostSlots(ctx, c.rdb)
	if err != nil || !lost.Any() {
		return false, 0, err
	}
	unlock, ok, err := c.store.TryLock(ctx, rebuildLockID)
	if err != nil || !ok {
		return false, 0, err
	}
	defer unlock()
	c.Gate.Lock()
	defer c.Gate.Unlock()
	// Another instance may have rebuilt between the check and the lock.
	if lost, err = limits.LostSlots(ctx, c.rdb); err != nil || !lost.Any() {
		return false, 0, err
	}
	// Recorded before the ledger is read: a reservation of the lost Redis
	// whose reserved event arrives after this is not in the rebuilt one.
	epoch := strconv.FormatInt(time.Now().UnixMilli(), 10)
	if err := c.store.MarkRebuild(ctx, epoch); err != nil {
		return false, 0, err
	}
	if err := limits.ClearLost(ctx, c.rdb, &lost); err != nil {
		return false, 0, err
	}
	subjects, err = c.rebuild(ctx, &lost)
	if err != nil {
		return false, subjects, err
	}
	if err := c.rebuildBalances(ctx, epoch, &lost); err != nil {
		return false, subjects, err
	}
	if err := c.restoreRecords(ctx, &lost); err != nil {
		return false, subjects, err
	}
	if err := limits.WriteEpoch(ctx, c.rdb, epoch); err != nil {
		return false, subjects, err
	}
	return true, subjects, nil
}

// windowRules are the token windows of tenant's subjects on plan for
// endpoint: what the ledger's usage is charged into (balances are rebuilt
// apart).
func (c *Corrector) windowRules(tenant, plan, endpoint string) ([]limits.Rule, error) {
	all, err := c.rules(tenant, plan, endpoint)
	if err != nil {
		return nil, err
	}
	var rules []limits.Rule
	for _, r := range all {
		if r.Unit == limits.Tokens && r.Kind != limits.Balance {
			rules = append(rules, r)
		}
	}
	return rules, nil
}

// rebuild charges the ledger's usage of the longest token window into the
// token windows (Charge with Force at each usage's time, many per round
// trip), subject by subject in time order. Request limits and concurrency
// slots start afresh; balances are rebuilt by rebuildBalances.
func (c *Corrector) rebuild(ctx context.Context, lost *limits.Lost) (int, error) {
	p := c.policy()
	w := p.LongestTokenWindow()
	if w == 0 {
		return 0, nil
	}
	subjects := 0
	var last ledger.Usage
	cache := map[[3]string][]limits.Rule{}
	var pending []limits.ChargeRequest // in the ledger's order, which ChargeMany keeps
	flush := func() error {
		for _, r := range c.lim.ChargeMany(ctx, pending) {
			if r.Err != nil {
				return r.Err
			}
		}
		pending = pending[:0]
		return nil
	}
	err := c.store.UsageSince(ctx, time.Now().Add(-w), func(u ledger.Usage) error {
		if !lost.Tenant(u.Tenant) {
			return nil // its slot kept its state
		}
		if u.Tenant != last.Tenant || u.User != last.User || subjects == 0 {
			subjects++
			last = u
		}
		k := [3]string{u.Tenant, u.Plan, u.Endpoint}
		rules, seen := cache[k]
		if !seen {
			var err error
			if rules, err = c.windowRules(u.Tenant, u.Plan, u.Endpoint); err != nil {
				return err
			}
			cache[k] = rules
		}
		if len(rules) == 0 {
			return nil
		}
		pending = append(pending, limits.ChargeRequest{
			Tenant: u.Tenant, User: u.User, Rules: rules, Amount: u.Tokens, At: u.At, Force: true,
		})
		if len(pending) < rebuildBatch {
			return nil
		}
		return flush()
	})
	if err == nil {
		err = flush()
	}
	if err != nil {
		return subjects, fmt.Errorf("rebuild: %w", err)
	}
	return subjects, nil
}

// rebuildBatch is how many charges a rebuild sends in one pipelined round
// trip.
const rebuildBatch = 500

// rebuildBalances puts back the prepaid balance of every subject that
// received a top-up: its top-ups as credit, what its requests hold as
// spent, under the balance limit of the subject's current plan (a subject
// whose plan has none keeps nothing in Redis). epoch makes a retried
// rebuild credit once: each subject's credit is a top-up with a reference
// of its own, since a top-up's reference is a key per tenant, not per user.
func (c *Corrector) rebuildBalances(ctx context.Context, epoch string, lost *limits.Lost) error {
	return c.store.Balances(ctx, func(b ledger.Balance) error {
		if !lost.Tenant(b.Tenant) {
			return nil
		}
		rules, err := c.rules(b.Tenant, "", "")
		if err != nil {
			return err
		}
		reference := "rebuild-" + events.HashID(epoch, b.User)
		for i := range rules {
			if r := &rules[i]; r.Kind == limits.Balance {
				if err := c.lim.RestoreBalance(ctx, b.Tenant, b.User, r, b.Credited, b.Spent, reference); err != nil {
					return fmt.Errorf("rebuild balance %s/%s: %w", b.Tenant, b.User, err)
				}
			}
		}
		return nil
	})
}

// restoreRecords puts back the reservation records the lost Redis held,
// as the ledger knows them (reserved or settled within the reservation
// TTL), under the rules of their plan and endpoint today: a retry of an
// open request is a duplicate again, not reserved a second time, its
// release or actual finds what it holds, and a settled or released id is
// refused again for the rest of its TTL.
func (c *Corrector) restoreRecords(ctx context.Context, lost *limits.Lost) error {
	var pending []limits.Restore
	flush := func() error {
		for i, err := range c.lim.RestoreMany(ctx, pending) {
			if err != nil {
				return fmt.Errorf("restore reservation %s/%s %s: %w", pending[i].Tenant, pending[i].User, pending[i].RequestID, err)
			}
		}
		pending = pending[:0]
		return nil
	}
	ttl := c.lim.ReservationTTL()
	err := c.store.RecentSince(ctx, time.Now(), ttl, func(r ledger.Recent) error {
		rs := restoreOf(r, ttl)
		if rs == nil || !lost.Tenant(r.Tenant) {
			return nil
		}
		if rs.State == limits.RecordOpen || rs.State == limits.RecordReleased {
			var err error
			if rs.Rules, err = c.rules(r.Tenant, r.Plan, r.Endpoint); err != nil {
				return err
			}
		}
		pending = append(pending, *rs)
		if len(pending) < rebuildBatch {
			return nil
		}
		return flush()
	})
	if err == nil {
		err = flush()
	}
	return err
}

// restoreOf is the record a reservation row stands for (nil: none, an open
// row without a reserved event, which no reserve wrote).
func restoreOf(r ledger.Recent, ttl time.Duration) *limits.Restore {
	est := max(r.Estimate, 0)
	if r.Local {
		est = 0 // no window holds it
	}
	rs := &limits.Restore{
		Tenant: r.Tenant, User: r.User, RequestID: r.RequestID, ReservedAt: r.At, Estimate: est,
		Expires: r.Since.Add(ttl),
	}
	if r.Estimate >= 0 {
		rs.Fingerprint = limits.Fingerprint(r.Endpoint, r.Plan, r.Model, r.Estimate)
	}
	switch {
	case r.Status == ledger.StatusSettled:
		rs.State = limits.RecordCorrected
	case r.Status == ledger.StatusReleased:
		rs.State = limits.RecordReleased
	case r.Estimate < 0:
		return nil
	case r.Local:
		rs.State = limits.RecordVoid
	default:
		rs.State = limits.RecordOpen
	}
	return rs
}

// ExpiryLedger is the part of the ledger the expiry task uses.
type ExpiryLedger interface {
	ExpireAtEstimate(ctx context.Context, cutoff time.Time) (int64, error)
	Expired(ctx context.Context, cutoff time.Time, limit int) ([]ledger.Reservation, error)
	MarkExpired(ctx context.Context, keys []ledger.Key, status string) error
}

// SettleExpired settles every reservation reserved before cutoff that got
// neither an actual nor a release, and returns how many. At the estimate
// (atEstimate), Redis already counts it and only the ledger changes, but
// for a reservation decided without Redis (local), whose estimate is
// charged now; otherwise the estimate is given back in Redis first (a
// local one has none to give back). A late actual of such a reservation
// is recorded in the ledger but corrects nothing.
func (c *Corrector) SettleExpired(ctx context.Context, l ExpiryLedger, cutoff time.Time, atEstimate bool) (int64, error) {
	var total int64
	if atEstimate {
		n, err := l.ExpireAtEstimate(ctx, cutoff) // all but the local ones
		if err != nil {
			return n, err
		}
		total = n
	}
	c.Gate.RLock()
	defer c.Gate.RUnlock()
	for {
		rows, err := l.Expired(ctx, cutoff, 500)
		if err != nil || len(rows) == 0 {
			return total, err
		}
		if atEstimate {
			n, err := c.chargeExpired(ctx, l, rows)
			total += n
			if err != nil {
				return total, err
			}
			continue
		}
		effects := make([]Effect, len(rows))
		for i, r := range rows {
			effects[i] = Effect{Release: true, Row: r}
		}
		keys := make([]ledger.Key, 0, len(rows))
		var failed error
		for i, o := range c.Apply(ctx, effects) {
			if r := rows[i]; o.Err != nil {
				failed = cmp.Or(failed, fmt.Errorf("release expired %s/%s %s: %w", r.Tenant, r.User, r.RequestID, o.Err))
				continue
			}
			keys = append(keys, rows[i].Key)
		}
		if err := l.MarkExpired(ctx, keys, ledger.StatusExpiredReleased); err != nil {
			return total, err
		}
		total += int64(len(keys))
		if failed != nil {
			return total, failed
		}
	}
}

// chargeExpired settles expired local rows at their estimate: each is
// corrected to its estimate, which charges it at its time where Redis holds
// nothing for it (the decision was made without Redis) and changes nothing
// where a Reserve that timed out did reserve it; then the rows are marked
// expired. A row Redis finds settled already waits for the event that
// settled it.
func (c *Corrector) chargeExpired(ctx context.Context, l ExpiryLedger, rows []ledger.Reservation) (int64, error) {
	effects := make([]Effect, len(rows))
	for i, r := range rows {
		effects[i] = Effect{Cost: max(r.Estimate, 0), Row: r}
	}
	keys := make([]ledger.Key, 0, len(rows))
	for i, o := range c.Apply(ctx, effects) {
		r := rows[i]
		if o.Err != nil {
			return 0, fmt.Errorf("charge expired %s/%s %s: %w", r.Tenant, r.User, r.RequestID, o.Err)
		}
		if st := o.Settlement.Status; st == limits.Settled || st == limits.ChargedUnknown {
			keys = append(keys, r.Key)
		}
	}
	if err := l.MarkExpired(ctx, keys, ledger.StatusExpired); err != nil {
		return 0, err
	}
	return int64(len(keys)), nil
}
