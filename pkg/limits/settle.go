package limits

import (
	"context"
	"time"

	"quotaflow/pkg/limits/internal/wire"
	"quotaflow/pkg/limits/policy"
)

// SettleStatus says what a Correct or Release did.
type SettleStatus int

// The outcomes of settling a reservation.
const (
	// Settled means the reservation was corrected or released now.
	Settled SettleStatus = iota + 1
	// AlreadySettled means an earlier call settled it; nothing changed.
	AlreadySettled
	// ChargedUnknown means Correct found no reservation (and no fallback):
	// the actual cost was charged in full at Redis's current time.
	ChargedUnknown
	// UnknownRelease means Release found no reservation: nothing to give back.
	UnknownRelease
)

// NoEstimate is a Fallback's Estimate when Redis's windows hold nothing for
// the reservation (it was decided without Redis, or none is known): an
// actual is then charged in full at the Fallback's time.
const NoEstimate = -1

// Fallback is the durable copy of a reservation (the accounter's ledger),
// used when Redis holds no record of it (expired, lost, or never made): the
// time its usage counts at, and the estimate the windows hold for it
// (NoEstimate: none).
type Fallback struct {
	ReservedAt time.Time
	Estimate   int64
}

// Settle identifies a reservation to correct or release. What it touches is
// what the reservation holds, as its record names it (its token limits and
// concurrency slots, under the rules of its admission); Rules are the
// subject's rules today, which the Settlement reports on (and which are
// settled instead when the record names none: a record of an earlier
// release, or none at all). Rules may hold every rule of the subject: only
// token limits and concurrency slots count, since a request once admitted
// stays counted in request limits.
type Settle struct {
	Tenant    string
	User      string
	RequestID string
	Actual    int64 // weighted tokens actually used (Correct only)
	Rules     []policy.Rule
	Fallback  *Fallback // optional
}

// Settlement is the result of Correct or Release.
type Settlement struct {
	Status SettleStatus
	// ByRelease says, when Status is AlreadySettled, that a release settled
	// the reservation (else a correction did, or it is still open and the
	// call was a release that only applies without a record).
	ByRelease bool
	// Estimate is what the reservation held before the call; with
	// AlreadySettled by a correction, what its actual was measured against
	// (0 after a release: the actual was charged in full).
	Estimate      int64
	Delta         int64     // tokens added to the windows (negative: given back)
	ReservedAt    time.Time // the time the correction was applied at
	Now           time.Time
	Version       int64
	TenantVersion int64
	States        []State // the limits of Settle.Rules after the change
}

// Correct moves every token window the reservation holds by actual -
// estimate, in the bucket of the reservation's time (windows that have slid
// past it are left alone), and frees its concurrency slots. After a release
// the actual is charged in full at that time: actual usage always wins. It
// applies once however often it is called. A request id with no reservation
// (and no Fallback estimate) is charged in full at the Fallback's time, or
// now.
func (l *Limiter) Correct(ctx context.Context, s Settle) (Settlement, error) {
	return l.settle(ctx, s, wire.SettleCorrect)
}

// Release gives the estimate and the concurrency slots of a reservation
// back, once. Actual is ignored. A reservation already corrected is left
// alone: a release after the actual changes nothing.
func (l *Limiter) Release(ctx context.Context, s Settle) (Settlement, error) {
	return l.settle(ctx, s, wire.SettleRelease)
}

// settle settles s alone: a batch of one.
func (l *Limiter) settle(ctx context.Context, s Settle, op int) (Settlement, error) {
	r := l.SettleMany(ctx, []SettleOp{{Settle: s, Release: op == wire.SettleRelease}})[0]
	return r.Settlement, r.Err
}

// addSettle adds the settle of op to b.
func (l *Limiter) addSettle(b *wire.SettleBatch, op *SettleOp) error {
	code := wire.SettleCorrect
	switch {
	case op.Release && op.IfGone:
		code = wire.SettleReleaseIfGone
	case op.Release:
		code = wire.SettleRelease
	}
	if l.general != "" && op.Tenant == l.general {
		code += wire.General
	}
	fbAt, fbEst := int64(-1), int64(-1)
	if fb := op.Fallback; fb != nil {
		if !fb.ReservedAt.IsZero() {
			fbAt = fb.ReservedAt.UnixMilli()
		}
		fbEst = max(fb.Estimate, NoEstimate)
	}
	return b.Add(op.Tenant, op.User, op.RequestID, code, op.Actual, op.Rules, fbAt, fbEst)
}

// settlement is the Settlement of settle reply v, over rules.
func settlement(v wire.SettleReply, rules []policy.Rule) Settlement {
	s := Settlement{
		Status:        SettleStatus(v.Status),
		Delta:         v.Delta,
		ReservedAt:    time.UnixMilli(v.ReservedAtMs),
		Now:           time.UnixMilli(v.NowMs),
		Version:       v.Version,
		TenantVersion: v.TenantVersion,
		Estimate:      v.Estimate,
		States:        wire.States[State](v.Limits, rules),
	}
	if s.Status == AlreadySettled {
		s.ByRelease = v.Prior == wire.RecordReleased
	}
	return s
}
