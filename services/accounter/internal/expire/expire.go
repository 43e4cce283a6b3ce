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
	ExpireAtEstimate(ctx context.Context, cutoff time.Time) (int64, error)
	Expired(ctx context.Context, cutoff time.Time, after ledger.Reservation, limit int) ([]ledger.Reservation, error)
	MarkExpired(ctx context.Context, keys []ledger.Key, status string) error
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
// neither an actual nor a release, and returns how many. At the estimate
// (atEstimate), Redis already counts it and only the ledger changes, but
// for a reservation decided without Redis (local), whose estimate is
// charged now; otherwise the estimate is given back in Redis first (a
// local one has none to give back). A late actual of such a reservation
// is recorded in the ledger but corrects nothing.
func (e *Expirer) settle(ctx context.Context, cutoff time.Time, atEstimate bool) (int64, error) {
	var total int64
	if atEstimate {
		n, err := e.store.ExpireAtEstimate(ctx, cutoff) // all but the local ones
		if err != nil {
			return n, err
		}
		total = n
	}
	// A row Redis finds settled already stays open, waiting for the event
	// that settled it: the pass pages past it, and meets it again next time.
	err := e.gate.Hold(func() error {
		var after ledger.Reservation
		for {
			rows, err := e.store.Expired(ctx, cutoff, after, pageSize)
			if err != nil || len(rows) == 0 {
				return err
			}
			var n int64
			if atEstimate {
				n, err = e.chargeExpired(ctx, rows)
			} else {
				n, err = e.releaseExpired(ctx, rows)
			}
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

// releaseExpired gives the estimates of expired rows back in Redis and
// marks the rows whose release applied expired; it returns how many it
// marked, and the first failure after marking the others.
func (e *Expirer) releaseExpired(ctx context.Context, rows []ledger.Reservation) (int64, error) {
	effs := make([]effects.Effect, len(rows))
	for i, r := range rows {
		effs[i] = effects.Effect{Release: true, Row: r}
	}
	keys := make([]ledger.Key, 0, len(rows))
	var failed error
	for i, o := range e.app.Apply(ctx, effs) {
		if r := rows[i]; o.Err != nil {
			failed = cmp.Or(failed, fmt.Errorf("release expired %s/%s %s: %w", r.Tenant, r.User, r.RequestID, o.Err))
			continue
		}
		keys = append(keys, rows[i].Key)
	}
	if err := e.store.MarkExpired(ctx, keys, ledger.StatusExpiredReleased); err != nil {
		return 0, err
	}
	return int64(len(keys)), failed
}

// chargeExpired settles expired local rows at their estimate: each is
// corrected to its estimate, which charges it at its time where Redis holds
// nothing for it (the decision was made without Redis) and changes nothing
// where a Reserve that timed out did reserve it; then the rows are marked
// expired. A row Redis finds settled already waits for the event that
// settled it.
func (e *Expirer) chargeExpired(ctx context.Context, rows []ledger.Reservation) (int64, error) {
	effs := make([]effects.Effect, len(rows))
	for i, r := range rows {
		effs[i] = effects.Effect{Cost: max(r.Estimate, 0), Row: r}
	}
	keys := make([]ledger.Key, 0, len(rows))
	for i, o := range e.app.Apply(ctx, effs) {
		r := rows[i]
		if o.Err != nil {
			return 0, fmt.Errorf("charge expired %s/%s %s: %w", r.Tenant, r.User, r.RequestID, o.Err)
		}
		if st := o.Settlement.Status; st == limits.Settled || st == limits.ChargedUnknown {
			keys = append(keys, r.Key)
		}
	}
	if err := e.store.MarkExpired(ctx, keys, ledger.StatusExpired); err != nil {
		return 0, err
	}
	return int64(len(keys)), nil
}
