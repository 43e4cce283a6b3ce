// Package rebuild puts Redis back from the ledger after it lost its data
// (a restart without persistence, a flush, a failover to an empty
// replica): the token windows of every subject active in the longest
// window, the prepaid balances and the reservation records, before the
// epoch key is written. Its Gate keeps the accounter's other writers of
// Redis out while a rebuild runs; Check is the accounter's periodic check.
package rebuild

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"quotaflow/pkg/events"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
	"quotaflow/pkg/limits/repair"
	"quotaflow/services/accounter/internal/effects"
	"quotaflow/services/accounter/internal/ledger"
)

// Ledger is what a rebuild reads from Postgres, and the lock and mark it
// takes there.
type Ledger interface {
	UsageSince(ctx context.Context, since time.Time, f func(ledger.Usage) error) error
	RecentSince(ctx context.Context, now time.Time, ttl time.Duration, f func(ledger.Recent) error) error
	Balances(ctx context.Context, f func(ledger.Balance) error) error
	TryLock(ctx context.Context, id int64) (unlock func(), ok bool, err error)
	MarkRebuild(ctx context.Context, epoch string) error
}

// Gate orders the accounter's writers of Redis and the ledger against a
// rebuild within one process: the consumers hold it from before a batch's
// ledger write until the ledger records that Redis holds its effects (the
// expiry task and the repairs likewise), and a rebuild runs only while no
// one holds it, so it never reads a ledger that is behind Redis. Holders
// take it before a ledger connection, so a rebuild waiting for it never
// finds the pool's connections held by holders queued behind it. The zero
// Gate is open; the Rebuilder's is Rebuilder.Gate.
type Gate struct{ mu sync.RWMutex }

// Hold runs f while no rebuild runs and returns its error; any number of
// holders run at once.
func (g *Gate) Hold(f func() error) error {
	g.mu.RLock()
	defer g.mu.RUnlock()
	return f()
}

// rebuildLockID is the Postgres advisory lock the accounter's instances
// take around a rebuild, so that only one of them charges the ledger into
// Redis ("qf-rebuild" as a number).
const rebuildLockID = 0x71662d7265627569

// Rebuilder rebuilds Redis from the ledger; most callers want Check, or
// EnsureEpoch. Its methods are safe for concurrent use; create it with New.
type Rebuilder struct {
	rep      *repair.Tools
	rdb      redis.UniversalClient
	policy   func() *policy.Policy
	store    Ledger
	gate     Gate
	log      *slog.Logger
	rebuilds *prometheus.CounterVec // by result
	failure  atomic.Pointer[string] // the last check's, for Degraded
}

// New returns a Rebuilder of rep's Redis, rdb, from store under the
// current policy from policy. Check logs to log and counts in
// quotaflow_accounter_rebuilds_total on reg (nil: not registered).
func New(rep *repair.Tools, rdb redis.UniversalClient, policy func() *policy.Policy, store Ledger, log *slog.Logger, reg prometheus.Registerer) (*Rebuilder, error) {
	rb := &Rebuilder{rep: rep, rdb: rdb, policy: policy, store: store, log: log.With("component", "rebuild"),
		rebuilds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "quotaflow_accounter_rebuilds_total",
			Help: "Rebuilds of Redis from the ledger after it lost its data, by result (ok, error).",
		}, []string{"result"})}
	rb.rebuilds.WithLabelValues("ok")
	rb.rebuilds.WithLabelValues("error")
	if reg != nil {
		if err := reg.Register(rb.rebuilds); err != nil {
			return nil, fmt.Errorf("rebuild: register metrics: %w", err)
		}
	}
	return rb, nil
}

// checkTimeout bounds one Check: a rebuild reads the ledger's usage of the
// longest window, which takes minutes on a large ledger, not hours.
const checkTimeout = 10 * time.Minute

// Check makes sure Redis holds its epoch, rebuilding it from the ledger
// when it lost its data (EnsureEpoch). It logs and counts a rebuild or a
// failure; a failure is what Degraded reports until a check succeeds. The
// accounter checks before it consumes (into a Redis without its epoch the
// scripts refuse, so every event would only be nakked) and then every
// QF_EPOCH_INTERVAL.
func (rb *Rebuilder) Check(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, checkTimeout)
	defer cancel()
	start := time.Now()
	rebuilt, subjects, err := rb.EnsureEpoch(ctx)
	if err != nil {
		msg := "epoch check or rebuild failed: " + err.Error()
		rb.failure.Store(&msg)
		rb.rebuilds.WithLabelValues("error").Inc()
		rb.log.Error("redis epoch check or rebuild failed; retrying", "err", err)
		return
	}
	rb.failure.Store(nil)
	if rebuilt {
		rb.rebuilds.WithLabelValues("ok").Inc()
		rb.log.Info("redis rebuilt from the ledger; epoch written", "subjects", subjects, "took", time.Since(start).String())
	}
}

// Degraded reports the last Check's failure, for obs.Readiness.Watch.
func (rb *Rebuilder) Degraded() (bool, string) {
	if e := rb.failure.Load(); e != nil {
		return true, *e
	}
	return false, ""
}

// Gate is the gate the rebuilds of r wait for: every writer of Redis's
// state in this process holds it.
func (rb *Rebuilder) Gate() *Gate { return &rb.gate }

// rules returns the subject rules of tenant on plan for endpoint under the
// current policy.
func (rb *Rebuilder) rules(tenant, plan, endpoint string) ([]policy.Rule, error) {
	return effects.Rules(rb.policy(), tenant, plan, endpoint)
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
func (rb *Rebuilder) EnsureEpoch(ctx context.Context) (rebuilt bool, subjects int, err error) {
	lost, err := repair.LostSlots(ctx, rb.rdb)
	if err != nil || !lost.Any() {
		return false, 0, err
	}
	unlock, ok, err := rb.store.TryLock(ctx, rebuildLockID)
	if err != nil || !ok {
		return false, 0, err
	}
	defer unlock()
	rb.gate.mu.Lock()
	defer rb.gate.mu.Unlock()
	// Another instance may have rebuilt between the check and the lock.
	if lost, err = repair.LostSlots(ctx, rb.rdb); err != nil || !lost.Any() {
		return false, 0, err
	}
	// Recorded before the ledger is read: a reservation of the lost Redis
	// whose reserved event arrives after this is not in the rebuilt one.
	epoch := strconv.FormatInt(time.Now().UnixMilli(), 10)
	if err := rb.store.MarkRebuild(ctx, epoch); err != nil {
		return false, 0, err
	}
	if err := repair.ClearLost(ctx, rb.rdb, &lost); err != nil {
		return false, 0, err
	}
	subjects, err = rb.rebuild(ctx, &lost)
	if err != nil {
		return false, subjects, err
	}
	if err := rb.rebuildBalances(ctx, epoch, &lost); err != nil {
		return false, subjects, err
	}
	if err := rb.restoreRecords(ctx, &lost); err != nil {
		return false, subjects, err
	}
	if err := repair.WriteEpoch(ctx, rb.rdb, epoch); err != nil {
		return false, subjects, err
	}
	return true, subjects, nil
}

// windowRules are the token windows of tenant's subjects on plan for
// endpoint: what the ledger's usage is charged into (balances are rebuilt
// apart).
func (rb *Rebuilder) windowRules(tenant, plan, endpoint string) ([]policy.Rule, error) {
	all, err := rb.rules(tenant, plan, endpoint)
	if err != nil {
		return nil, err
	}
	var rules []policy.Rule
	for _, r := range all {
		if r.Unit == policy.Tokens && r.Kind != policy.Balance {
			rules = append(rules, r)
		}
	}
	return rules, nil
}

// rebuild charges the ledger's usage of the longest token window into the
// token windows (Charge with Force at each usage's time, many per round
// trip), subject by subject in time order. Request limits and concurrency
// slots start afresh; balances are rebuilt by rebuildBalances.
func (rb *Rebuilder) rebuild(ctx context.Context, lost *repair.Lost) (int, error) {
	p := rb.policy()
	w := p.LongestTokenWindow()
	if w == 0 {
		return 0, nil
	}
	subjects := 0
	var last ledger.Usage
	cache := map[[3]string][]policy.Rule{}
	var pending []repair.ChargeRequest // in the ledger's order, which ChargeMany keeps
	flush := func() error {
		for _, r := range rb.rep.ChargeMany(ctx, pending) {
			if r.Err != nil {
				return r.Err
			}
		}
		pending = pending[:0]
		return nil
	}
	err := rb.store.UsageSince(ctx, time.Now().Add(-w), func(u ledger.Usage) error {
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
			if rules, err = rb.windowRules(u.Tenant, u.Plan, u.Endpoint); err != nil {
				return err
			}
			cache[k] = rules
		}
		if len(rules) == 0 {
			return nil
		}
		pending = append(pending, repair.ChargeRequest{
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
func (rb *Rebuilder) rebuildBalances(ctx context.Context, epoch string, lost *repair.Lost) error {
	return rb.store.Balances(ctx, func(b ledger.Balance) error {
		if !lost.Tenant(b.Tenant) {
			return nil
		}
		rules, err := rb.rules(b.Tenant, "", "")
		if err != nil {
			return err
		}
		reference := "rebuild-" + events.HashID(epoch, b.User)
		for i := range rules {
			if r := &rules[i]; r.Kind == policy.Balance {
				spent, err := rb.spent(b, r)
				if err != nil {
					return err
				}
				if err := rb.rep.RestoreBalance(ctx, b.Tenant, b.User, r, b.Credited, spent, reference); err != nil {
					return fmt.Errorf("rebuild balance %s/%s: %w", b.Tenant, b.User, err)
				}
			}
		}
		return nil
	})
}

// spent is what b's requests spent of the balance limit bal: their usage
// under the plans whose rules hold bal (resolved as the corrections
// resolve a row's plan, effects.Rules), for Redis spends a balance only for
// requests under such a plan; a subject's usage under another plan (before
// a plan change, or through a token naming another plan) spent nothing.
func (rb *Rebuilder) spent(b ledger.Balance, bal *policy.Rule) (int64, error) {
	var n int64
	for plan, tokens := range b.Spent {
		rules, err := rb.rules(b.Tenant, plan, "")
		if err != nil {
			return 0, err
		}
		if slices.ContainsFunc(rules, func(r policy.Rule) bool { return r.ID() == bal.ID() }) {
			n += tokens
		}
	}
	return n, nil
}

// restoreRecords puts back the reservation records the lost Redis held,
// as the ledger knows them (reserved or settled within the reservation
// TTL), under the rules of their plan and endpoint today: a retry of an
// open request is a duplicate again, not reserved a second time, its
// release or actual finds what it holds, and a settled or released id is
// refused again for the rest of its TTL.
func (rb *Rebuilder) restoreRecords(ctx context.Context, lost *repair.Lost) error {
	var pending []repair.Restore
	flush := func() error {
		for i, err := range rb.rep.RestoreMany(ctx, pending) {
			if err != nil {
				return fmt.Errorf("restore reservation %s/%s %s: %w", pending[i].Tenant, pending[i].User, pending[i].RequestID, err)
			}
		}
		pending = pending[:0]
		return nil
	}
	ttl := rb.rep.ReservationTTL()
	err := rb.store.RecentSince(ctx, time.Now(), ttl, func(r ledger.Recent) error {
		rs := restoreOf(r, ttl)
		if rs == nil || !lost.Tenant(r.Tenant) {
			return nil
		}
		if rs.State == repair.RecordOpen || rs.State == repair.RecordReleased {
			var err error
			if rs.Rules, err = rb.rules(r.Tenant, r.Plan, r.Endpoint); err != nil {
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
func restoreOf(r ledger.Recent, ttl time.Duration) *repair.Restore {
	est := max(r.Estimate, 0)
	if r.Local {
		est = 0 // no window holds it
	}
	rs := &repair.Restore{
		Tenant: r.Tenant, User: r.User, RequestID: r.RequestID, ReservedAt: r.At, Estimate: est,
		Expires: r.Since.Add(ttl),
	}
	if r.Estimate >= 0 {
		rs.Fingerprint = limits.Fingerprint(r.Endpoint, r.Plan, r.Model, r.Estimate)
	}
	switch {
	case r.Status == ledger.StatusSettled:
		rs.State = repair.RecordCorrected
	case r.Status == ledger.StatusReleased:
		rs.State = repair.RecordReleased
	case r.Estimate < 0:
		return nil
	case r.Local:
		rs.State = repair.RecordVoid
	default:
		rs.State = repair.RecordOpen
	}
	return rs
}
