package limits

import (
	"context"

	"quotaflow/pkg/limits/internal/script"
	"quotaflow/pkg/limits/internal/wire"
)

// VoidStatus says what VoidReserve did.
type VoidStatus int

// The outcomes of VoidReserve.
const (
	// Voided means an open reservation was given back: the lost call's own,
	// or, for an allowed request, one of the same request (fingerprint).
	Voided VoidStatus = iota + 1
	// VoidMarked means no reservation was found; a marker now stops the
	// lost call from reserving should it still run.
	VoidMarked
	// VoidLeft means the request id's record is another call's, or
	// settled: nothing changed.
	VoidLeft
)

// Void names a Reserve call whose reply was lost (it timed out, so it may
// or may not have run in Redis) and the decision the caller made without
// it.
type Void struct {
	Tenant, User, RequestID string
	Fingerprint, Nonce      int64 // the lost call's Request fields
	Allowed                 bool  // the decision made without Redis
}

// VoidReserve makes Redis agree with a decision taken without it, after a
// Reserve whose reply was lost: whatever that call reserved is given back,
// so the request holds nothing in Redis (a local decision's reserved event
// says no window holds it, and its actual is charged in full). For an
// allowed request the id stays recorded as holding nothing, so a repeat of
// the request is a Duplicate and a settlement finds it; for a denied one no
// record stays (the id may be admitted later) except a short-lived marker,
// when the call had not run, that stops that call alone. It is idempotent.
func (l *Limiter) VoidReserve(ctx context.Context, v Void) (VoidStatus, error) {
	r := l.VoidMany(ctx, []Void{v})[0]
	return r.Status, r.Err
}

// VoidResult is the outcome of one Void of VoidMany.
type VoidResult struct {
	Status VoidStatus
	Err    error
}

// VoidMany makes every VoidReserve of vs, in one pipelined round trip (one
// per Cluster node), and returns their outcomes in order.
func (l *Limiter) VoidMany(ctx context.Context, vs []Void) []VoidResult {
	calls := make([]wire.Call, len(vs))
	for i, v := range vs {
		calls[i] = l.p.VoidCall(v.Tenant, v.User, v.RequestID, v.Fingerprint, v.Nonce, v.Allowed)
	}
	cmds := l.run.RunAll(ctx, script.Void, calls)
	out := make([]VoidResult, len(vs))
	for i := range calls {
		if calls[i].Err != nil {
			out[i].Err = calls[i].Err
			continue
		}
		n, err := wire.DecodeVoid(cmds[i], &calls[i])
		out[i] = VoidResult{Status: VoidStatus(n), Err: err}
	}
	return out
}

// Admitted reports whether request id of (tenant, user) has a reservation
// record, i.e. was admitted (and possibly settled) within ReservationTTL.
// The marker VoidReserve leaves for a denied request (VoidMarked) is no
// admission. Admission asks it when a shared layer denies a request whose
// id the caller chose: a retry of an admitted request gets its stored
// decision, never a denial by a layer it already passed.
func (l *Limiter) Admitted(ctx context.Context, tenant, user, requestID string) (bool, error) {
	c := wire.AdmittedCall(tenant, user, requestID)
	if c.Err != nil {
		return false, c.Err
	}
	return wire.DecodeAdmitted(l.run.Run(ctx, script.Admitted, &c), &c)
}
