// Package expire settles the reservations that got neither an actual nor
// a release within their TTL: at their estimate, or given back.
package expire

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"quotaflow/pkg/limits"
	"quotaflow/services/accounter/internal/effects"
	"quotaflow/services/accounter/internal/ledger"
	"quotaflow/services/accounter/internal/rebuild"
)

// Ledger is the part of the ledger the expiry task uses.
type Ledger interface {
	BeginExpired(ctx context.Context, cutoff time.Time, after ledger.Reservation, limit int) (*ledger.Tx, []ledger.Reservation, error)
}

// Options say which reservations have expired and how they are settled.
type Options struct {
	// TTL is how long a reservation waits for its actual event:
	// QF_RESERVATION_TTL.
	TTL time.Duration
	// AtEstimate settles an expired reservation at its estimate; false
	// gives the estimate back: QF_SETTLE_EXPIRED_AT_ESTIMATE.
	AtEstimate bool
}

// Expirer settles expired reservations; call Expire from one goroutine at
// a time. Create it with New.
type Expirer struct {
	app     *effects.Applier
	store   Ledger
	gate    *rebuild.Gate
	opt     Options
	log     *slog.Logger
	expired prometheus.Counter
}

// New returns an Expirer of the reservations in store, applying their
// effects in Redis through app while holding gate. Expire logs to log and
// counts in quotaflow_accounter_expired_reservations_total on reg (nil:
// not registered).
func New(app *effects.Applier, store Ledger, gate *rebuild.Gate, opt Options, log *slog.Logger, reg prometheus.Registerer) (*Expirer, error) {
	e := &Expirer{app: app, store: store, gate: gate, opt: opt, log: log.With("component", "expire"),
		expired: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "quotaflow_accounter_expired_reservations_total",
			Help: "Reservations settled by the expiry task because no actual event came before their TTL.",
		})}
	if reg != nil {
		if err := reg.Register(e.expired); err != nil {
			return nil, fmt.Errorf("expire: register metrics: %w", err)
		}
	}
	return e, nil
}

// Expire settles the reservations that have expired by now, logging and
// counting them; a failure is logged and the next call tries again. The
// accounter calls it every QF_EXPIRY_INTERVAL.
func (e *Expirer) Expire(ctx context.Context) {
	n, err := e.settle(ctx, time.Now().Add(-e.opt.TTL), e.opt.AtEstimate)
	e.expired.Add(float64(n))
	if err != nil {
		e.log.Error("settling expired reservations failed; retrying", "err", err)
	} else if n > 0 {
		e.log.Info("settled expired reservations", "count", n, "at_estimate", e.opt.AtEstimate)
	}
}

// settle settles every reservation reserved before cutoff that got
// neither an actual nor a release, and returns how many, a page at a time:
// in Redis first, at its estimate (atEstimate: corrected to it, which
// changes nothing where Redis holds the reservation and charges it where
// the decision was made without Redis, local) or given back, then in the
// ledger, whose page holds the rows locked from before Redis (a batch
// bringing an actual meanwhile waits, finds the row expired, and records
// the actual without correcting anything). A row Redis finds corrected
// already stays open: Redis took its actual and the ledger's commit was
// lost (a crash), and Redis keeps no record of what that actual was, so
// the row waits for the actual's redelivery; the pass pages past it.
func (e *Expirer) settle(ctx context.Context, cutoff time.Time, atEstimate bool) (int64, error) {
	var total int64
	err := e.gate.Hold(func() error {
		var after ledger.Reservation
		for {
			tx, rows, err := e.store.BeginExpired(ctx, cutoff, after, pageSize)
			if err != nil {
				return err
			}
			n, err := e.expire(ctx, tx, rows, atEstimate)
			total += n
			if err != nil || len(rows) < pageSize {
				return err
			}
			after = rows[len(rows)-1]
		}
	})
	return total, err
}

// pageSize is how many expired reservations settle at a time.
const pageSize = 500

// expire settles rows in Redis and commits tx, which locks them, with the
// rows Redis settled now marked; it returns how many it marked, and the
// first failure after marking the others.
func (e *Expirer) expire(ctx context.Context, tx *ledger.Tx, rows []ledger.Reservation, atEstimate bool) (int64, error) {
	defer tx.Rollback(ctx) // unless committed
	status := ledger.StatusExpiredReleased
	if atEstimate {
		status = ledger.StatusExpired
	}
	effs := make([]effects.Effect, len(rows))
	for i, r := range rows {
		effs[i] = effects.Effect{Release: !atEstimate, Cost: max(r.Estimate, 0), Row: r}
	}
	var marks []ledger.Mark
	var failed error
	for i, o := range e.app.Apply(ctx, effs) {
		r, s := rows[i], o.Settlement
		switch {
		case o.Err != nil:
			failed = cmp.Or(failed, fmt.Errorf("settle expired %s/%s %s: %w", r.Tenant, r.User, r.RequestID, o.Err))
		// AlreadySettled by a correction: left open (see settle); by a
		// release: given back, as expiring it would.
		case s.Status != limits.AlreadySettled || s.ByRelease && !atEstimate:
			marks = append(marks, ledger.Mark{Key: r.Key, Status: status})
		}
	}
	if err := tx.Commit(ctx, marks); err != nil {
		return 0, err
	}
	return int64(len(marks)), failed
}
