package repair

import (
	"context"
	"errors"
	"fmt"
	"time"

	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/internal/script"
	"quotaflow/pkg/limits/internal/wire"
	"quotaflow/pkg/limits/policy"
)

// Tools read and rewrite what the engine keeps in Redis, for the
// accounter: its rebuild after Redis lost its data and its reconciliation
// with the ledger. Like a Limiter, every method is one script call (the
// ...Many methods pipeline many) and is safe for concurrent use. Create
// them with New.
type Tools struct {
	run *script.Runner
	p   wire.Params
}

// New returns the Tools over c, with the Options of the Limiters whose
// state they repair (ReservationTTL, NoEpochGuard, ClockOffset).
func New(c limits.Client, o limits.Options) *Tools {
	return &Tools{run: script.NewRunner(c), p: wire.NewParams(o.ReservationTTL, o.NoEpochGuard, o.ClockOffset)}
}

// ReservationTTL is how long a reservation record lives unless it is
// settled (limits.Options.ReservationTTL): how far back RestoreMany puts
// records back.
func (t *Tools) ReservationTTL() time.Duration { return t.p.ReservationTTL() }

// ChargeRequest names the counters and the amount of a Charge.
type ChargeRequest struct {
	Tenant, User string // the subject
	Rules        []policy.Rule
	Amount       int64     // weighted tokens; requests limits move by 1 in its direction
	At           time.Time // zero: now
	Force        bool      // apply even when the epoch is missing (ledger rebuild)
}

// Charge adds amount (negative gives back) to rules at time at (zero:
// now), without a reservation record: a window that has slid past at is
// left alone. Tenant and user name the counters. The reconciliation
// moves a drifted window with it; the rebuild charges the ledger's usage
// with Force, after Redis lost its data. It returns the limits after the change, or
// limits.ErrNoEpoch without Force when the epoch is missing.
func (t *Tools) Charge(ctx context.Context, c ChargeRequest) ([]limits.State, error) {
	cl := t.chargeCall(&c)
	if cl.Err != nil {
		return nil, cl.Err
	}
	return wire.DecodeCharge[limits.State](t.run.Run(ctx, script.Charge, &cl), &cl)
}

func (t *Tools) chargeCall(c *ChargeRequest) wire.Call {
	return t.p.ChargeCall(c.Tenant, c.User, "", "", c.Rules, c.Amount, c.At, c.Force)
}

// ChargeResult is what Charge would have returned for one request of
// ChargeMany.
type ChargeResult struct {
	States []limits.State
	Err    error
}

// ChargeMany charges every request as Charge does, in order, in one
// pipelined round trip (one per node of a Redis Cluster), with the result
// of the same calls made one by one. An invalid request or a failed call
// fails only its own result.
func (t *Tools) ChargeMany(ctx context.Context, reqs []ChargeRequest) []ChargeResult {
	calls := make([]wire.Call, len(reqs))
	for i := range reqs {
		calls[i] = t.chargeCall(&reqs[i])
	}
	cmds := t.run.RunAll(ctx, script.Charge, calls)
	out := make([]ChargeResult, len(reqs))
	for i := range calls {
		if calls[i].Err != nil {
			out[i].Err = calls[i].Err
			continue
		}
		out[i].States, out[i].Err = wire.DecodeCharge[limits.State](cmds[i], &calls[i])
	}
	return out
}

// RestoreBalance puts a balance lost with Redis's data back from the
// ledger: credited credits (once per reference: use one per rebuild) and
// spent spent, even while the epoch is missing. Call it before WriteEpoch,
// on a balance that has not been used since Redis came back empty.
func (t *Tools) RestoreBalance(ctx context.Context, tenant, user string, r *policy.Rule, credited, spent int64, reference string) error {
	if credited > 0 {
		c := t.p.TopUpCall(tenant, user, r, credited, reference, true)
		if c.Err != nil {
			return c.Err
		}
		if _, _, _, err := wire.DecodeTopUp(t.run.Run(ctx, script.TopUp, &c), &c); err != nil {
			return err
		}
	}
	if spent <= 0 {
		return nil
	}
	_, err := t.Charge(ctx, ChargeRequest{Tenant: tenant, User: user, Rules: []policy.Rule{*r}, Amount: spent, Force: true})
	return err
}

// RecordState is the state a restored reservation record says its request
// is in.
type RecordState int

// The states of a restored record.
const (
	// RecordOpen: reserved, not settled; Redis's windows hold its estimate.
	RecordOpen RecordState = wire.RecordOpen
	// RecordCorrected: its actual usage was applied.
	RecordCorrected RecordState = wire.RecordCorrected
	// RecordReleased: its estimate was given back; an actual is still
	// charged in full.
	RecordReleased RecordState = wire.RecordReleased
	// RecordVoid: admitted without Redis, not settled; no window holds it.
	RecordVoid RecordState = wire.RecordVoid
)

// Restore is a reservation record to put back after Redis lost its data,
// as the accounter's ledger knows it (RestoreMany).
type Restore struct {
	Tenant, User, RequestID string
	State                   RecordState
	// Fingerprint is of the request's endpoint, plan, model and estimate
	// (limits.Fingerprint), so that a retry of the same request is a
	// Duplicate again.
	Fingerprint int64
	ReservedAt  time.Time // when its usage counts
	Estimate    int64     // what the windows hold for it while it is open
	// Rules are the rules it was admitted under (as the ledger's plan and
	// endpoint resolve today): what its settlement touches. Only an open
	// or a released record needs them.
	Rules   []policy.Rule
	Expires time.Time // when the record would have expired
}

// RestoreMany puts back reservation records after Redis lost its data, in
// one pipelined round trip: an open reservation's, so that a retry of its
// request is a Duplicate again and its settlement finds what it holds, and
// a settled or released one's, so that its id is refused again for the
// rest of its TTL. A request id that has a record already is left alone, a
// record past its expiry is skipped. It writes no window: rebuild those
// with Charge. It returns one error per restore (nil for the restored and
// the skipped).
func (t *Tools) RestoreMany(ctx context.Context, rs []Restore) []error {
	calls := make([]wire.Call, len(rs))
	now := time.Now()
	for i, r := range rs {
		calls[i] = t.p.RestoreCall(r.Tenant, r.User, r.RequestID, byte(r.State), r.Fingerprint, r.ReservedAt, r.Estimate, r.Rules, r.Expires)
		if calls[i].Err == nil && !r.Expires.After(now) {
			calls[i].Err = errSkip
		}
	}
	cmds := t.run.RunAll(ctx, script.Restore, calls)
	errs := make([]error, len(rs))
	for i, c := range calls {
		switch {
		case errors.Is(c.Err, errSkip):
		case c.Err != nil:
			errs[i] = c.Err
		default:
			if err := cmds[i].Err(); err != nil {
				errs[i] = fmt.Errorf("%s: %w", c.What, err)
			}
		}
	}
	return errs
}

// errSkip marks a call RestoreMany has no need to make.
var errSkip = errors.New("skip")
