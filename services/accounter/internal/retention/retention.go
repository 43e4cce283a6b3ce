// Package retention keeps the ledger's time partitions (docs/design.md §6):
// it creates them ahead of the days to come and drops those older than the
// retention, which it refuses while the retention is shorter than its
// floor: Redis is rebuilt and reconciled from the ledger, so the ledger
// must keep everything a window can still hold.
package retention

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"quotaflow/internal/obs"
	"quotaflow/internal/service"
	"quotaflow/pkg/limits/policy"
	"quotaflow/services/accounter/internal/ledger"
)

// DefaultDays is the retention's default, in days (QF_LEDGER_RETENTION_DAYS).
const DefaultDays = 90

// Day is a retention's and a partition's unit.
const Day = 24 * time.Hour

// MinWindow is the window the floor covers at least: a calendar month,
// which every policy may hold (31 days, the rebuild's reach for one).
const MinWindow = 31 * Day

// Floor is the shortest retention that keeps what Redis may be rebuilt or
// reconciled from: the longest token window, at least MinWindow, and two
// reservation TTLs (a reservation settles, and its record lives, a TTL
// after it was reserved: what the rebuild's recent reservations read),
// rounded up to whole days.
func Floor(longest, ttl time.Duration) time.Duration {
	f := max(longest, MinWindow) + 2*ttl
	return (f + Day - 1) / Day * Day
}

// Store is the part of the ledger the keeper uses.
type Store interface {
	EnsurePartitions(ctx context.Context, now time.Time, width int) ([]ledger.Partition, error)
	DropPartitions(ctx context.Context, now time.Time, retention, floor time.Duration) ([]ledger.Partition, error)
}

// Options are the partitions' width and the retention.
type Options struct {
	// PartitionDays is the width of a new partition, in days:
	// QF_LEDGER_PARTITION_DAYS.
	PartitionDays int
	// RetentionDays is how many days the ledger keeps, 0 for ever:
	// QF_LEDGER_RETENTION_DAYS.
	RetentionDays int
	// TTL is QF_RESERVATION_TTL, part of the floor.
	TTL time.Duration
}

// Keeper creates and drops partitions; call Keep from one goroutine at a
// time (instances agree through the ledger's advisory lock). Create it
// with New.
type Keeper struct {
	store   Store
	policy  func() *policy.Policy
	opt     Options
	log     *slog.Logger
	runs    *prometheus.CounterVec
	dropped prometheus.Counter
}

// New returns a Keeper of store's partitions, whose floor comes from the
// policy in force. It counts on reg (nil: not registered)
// quotaflow_accounter_partition_runs_total by result (ok, error, refused:
// the retention is under the floor) and
// quotaflow_accounter_partitions_dropped_total.
func New(store Store, pol func() *policy.Policy, opt Options, log *slog.Logger, reg prometheus.Registerer) (*Keeper, error) {
	k := &Keeper{store: store, policy: pol, opt: opt, log: log.With("component", "retention"),
		runs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "quotaflow_accounter_partition_runs_total",
			Help: "Runs of the ledger's partition task (create ahead, drop past the retention), by result: ok, error, refused (the retention is shorter than the floor the policy in force needs; nothing dropped).",
		}, []string{"result"}),
		dropped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "quotaflow_accounter_partitions_dropped_total",
			Help: "Ledger partitions dropped by the retention.",
		})}
	for _, r := range []string{"ok", "error", "refused"} {
		k.runs.WithLabelValues(r)
	}
	if err := obs.Register(reg, k.runs, k.dropped); err != nil {
		return nil, fmt.Errorf("retention: register metrics: %w", err)
	}
	return k, nil
}

// Keep creates the partitions up to ledger.AheadDays ahead of now and,
// with a retention set, drops those past it; a failure is logged and
// counted. It reports whether the run failed (a refusal is no failure:
// trying again soon changes nothing). The accounter calls it at start,
// then through Run.
func (k *Keeper) Keep(ctx context.Context) (failed bool) {
	result := "ok"
	if err := k.keep(ctx, time.Now()); errors.Is(err, ledger.ErrRetentionTooShort) {
		result = "refused"
		k.log.Error("not dropping ledger partitions: the retention is shorter than the policy needs (QF_LEDGER_RETENTION_DAYS)", "err", err)
	} else if err != nil {
		result = "error"
		k.log.Error("keeping the ledger's partitions failed; retrying", "err", err)
	}
	k.runs.WithLabelValues(result).Inc()
	return result == "error"
}

// Run calls Keep every interval until ctx ends, or retry after a failed
// run (failed: the run before), so that a run which lost to a lock
// (lock_timeout) or a deadlock does not wait an hour.
func (k *Keeper) Run(ctx context.Context, failed bool, interval, retry time.Duration) {
	for {
		wait := interval
		if failed {
			wait = retry
		}
		if !service.Sleep(ctx, wait) {
			return
		}
		failed = k.Keep(ctx)
	}
}

func (k *Keeper) keep(ctx context.Context, now time.Time) error {
	created, err := k.store.EnsurePartitions(ctx, now, k.opt.PartitionDays)
	for _, p := range created {
		k.log.Info("created a ledger partition", "partition", p.Name, "from", p.From.Format(time.DateOnly), "to", p.To.Format(time.DateOnly))
	}
	if err != nil || k.opt.RetentionDays == 0 {
		return err
	}
	p := k.policy()
	if p == nil {
		return nil // no policy yet: its floor is unknown
	}
	dropped, err := k.store.DropPartitions(ctx, now, time.Duration(k.opt.RetentionDays)*Day, Floor(p.LongestTokenWindow(), k.opt.TTL))
	for _, p := range dropped {
		k.log.Info("dropped a ledger partition past the retention", "partition", p.Name, "to", p.To.Format(time.DateOnly))
	}
	k.dropped.Add(float64(len(dropped)))
	return err
}
