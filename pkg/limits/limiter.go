package limits

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/pkg/limits/internal/script"
	"quotaflow/pkg/limits/internal/wire"
	"quotaflow/pkg/limits/policy"
)

// Errors returned by the Limiter. A denial is not an error: it is a Decision
// with Allowed false.
var (
	// ErrNoEpoch means Redis holds no epoch for the slot: it lost its data and
	// the windows have not been rebuilt yet. Nothing was decided or changed;
	// decide locally until the accounter's rebuild writes the epoch.
	ErrNoEpoch = wire.ErrNoEpoch
	// ErrInvalid wraps every rejected argument (empty tenant, negative cost...).
	ErrInvalid = wire.ErrInvalid
)

// SlotMoving reports whether err is a Cluster's refusal of a call whose
// tenant's slot is being moved (TRYAGAIN, or a MOVED or ASK the client did
// not follow), still there when ctx ended or the retries gave up: the call
// did not run, and says nothing of the other tenants' masters.
func SlotMoving(err error) bool { return script.SlotMoving(err) }

// MaxID is the longest tenant, user, endpoint, IP, request id or reference,
// in bytes: ident.MaxLen, the one rule every boundary applies.
const MaxID = wire.MaxID

// MaxCost is the largest cost or amount the engine accepts, 1e12: counters
// are 48-bit integers in Redis, and saturate there.
const MaxCost = wire.MaxCost

// Client is what a Limiter needs from go-redis: scripts, and Redis
// functions where the server has them. *redis.Client (single node or
// Sentinel failover), *redis.ClusterClient and *redis.Ring satisfy it.
type Client interface {
	redis.Scripter
	FunctionLoad(ctx context.Context, code string) *redis.StringCmd
	Process(ctx context.Context, cmd redis.Cmder) error
}

// DefaultReservationTTL is how long a reservation lives when nobody settles
// it, unless Options say otherwise: a day, the usage stream's default max
// age, so that an actual event as late as the stream keeps it still finds
// its reservation. Every service's QF_RESERVATION_TTL defaults to it.
const DefaultReservationTTL = wire.DefaultReservationTTL

// Options configure a Limiter. The zero value is ready to use.
type Options struct {
	// ReservationTTL is how long a reservation record (and a concurrency
	// slot) lives when nobody settles it; it must be at least the event
	// stream's max age so a late actual can still be corrected exactly.
	// Zero means DefaultReservationTTL.
	ReservationTTL time.Duration
	// NoEpochGuard makes the scripts decide even when the epoch key is
	// missing, for setups without an accounter (request-rate-only limits,
	// isolated tests).
	NoEpochGuard bool
	// ClockOffset shifts Redis time as the scripts see it. It exists for
	// tests and demos that need to move through windows; leave it zero.
	ClockOffset time.Duration
	// checkFast makes reserves and settles check their fast paths, and the
	// tenant general's (none: "") take the general path alone
	// (export_test.go).
	checkFast bool
	general   string
}

// Limiter checks and reserves limits in Redis. Every method is one script
// call (one round trip; ReserveBatch decides many reserves in one call,
// SettleMany and VoidMany pipeline many) and is safe for concurrent use; all state lives in Redis, so any
// number of Limiters on any number of hosts agree.
//
// Most callers want Reserve before a request and Correct or Release after.
type Limiter struct {
	run     *script.Runner
	p       wire.Params
	general string // a tenant whose calls take the engine's general path alone (tests)
}

// New returns a Limiter over c, which may be a single node, a Sentinel
// failover client or a Redis Cluster client.
func New(c Client, o Options) *Limiter {
	p := wire.NewParams(o.ReservationTTL, o.NoEpochGuard, o.ClockOffset)
	if o.checkFast {
		p = p.CheckingFast()
	}
	return &Limiter{run: script.NewRunner(c), p: p, general: o.general}
}

// DropOtherEngines deletes from Redis the Lua engine of every other
// version of this package (script.Runner.DropOtherVersions): each release
// loads its own, which stays until deleted. It returns their names.
// Services call it once at start.
func (l *Limiter) DropOtherEngines(ctx context.Context) ([]string, error) {
	return l.run.DropOtherVersions(ctx)
}

// SlotBound reports whether the Redis behind l keeps each tenant in one
// hash slot of several that lose their data apart (a Redis Cluster's
// masters, a Ring's shards), so that one tenant's ErrNoEpoch says nothing of
// the others; on one node (or Sentinel's) every tenant loses it together.
func (l *Limiter) SlotBound() bool { return l.run.SlotBound() }

// ReservationTTL is how long a reservation record lives unless it is
// settled (Options.ReservationTTL).
func (l *Limiter) ReservationTTL() time.Duration { return l.p.ReservationTTL() }

// Request is one reservation: Cost weighted tokens for request RequestID of
// (Tenant, User), checked against Rules, the subject's tenant-wide and user
// limits (Resolved.Subject of the policy).
//
// RequestID is an idempotency key only while its reservation is open and
// only for the same request, which Fingerprint identifies (see
// Fingerprint), and never over rules that keep no record (KeepsRecord): a Reserve of an open reservation's id with the same
// fingerprint is a Duplicate; with another, or of a settled one, a
// Conflict. Fresh asks for a request id no record holds at all
// (ConflictReused otherwise), for callers to whom every call is a new
// request. Nonce tells this call apart from every other Reserve of the id,
// so that VoidReserve can undo exactly this call if its reply is lost;
// zero is fine when the caller never voids.
//
// Counted keeps Rules in counters when they are Counted; the caller sets it
// only when every request over any of these windows sets it too (the
// policy's Resolved.Counted), since a window kept in counters by some
// requests and in the blob by others would admit its limit in each.
type Request struct {
	Tenant      string
	User        string
	RequestID   string
	Cost        int64
	Rules       []policy.Rule
	Fingerprint int64
	Nonce       int64
	Fresh       bool
	Counted     bool
}

// State is one limit after a decision, correction or peek.
type State struct {
	Rule      *policy.Rule // the rule, from the slice the caller passed
	Limit     int64        // the limit; for a balance, the credits topped up so far
	Used      int64
	Remaining int64
	// Reset is the time until the limit next frees capacity (rolling,
	// token_bucket, sliding_log) or resets (fixed, calendar_month); zero when
	// nothing is used or it never resets (balance, concurrency).
	Reset     time.Duration
	WouldDeny bool // a shadow limit that would have denied
}

// Reason explains a denial that waiting alone cannot cure.
type Reason string

// Reasons of a Decision.
const (
	ReasonNone                Reason = ""
	ReasonCostExceedsLimit    Reason = "cost_exceeds_limit"   // the cost is larger than a limit itself
	ReasonInsufficientBalance Reason = "insufficient_balance" // only a top-up helps
	// ReasonRequestIDReused: a Fresh request's id has a record (admission
	// reports ConflictReused so).
	ReasonRequestIDReused Reason = "request_id_reused"
)

// Conflict says why a Reserve refused a request id without deciding.
type Conflict int

// The conflicts of a Decision.
const (
	NoConflict Conflict = iota
	// ConflictRequest: the id's open reservation is of a different request
	// (another fingerprint).
	ConflictRequest
	// ConflictSettled: the id's reservation was settled or released.
	ConflictSettled
	// ConflictReused: Fresh was set and the id has a record.
	ConflictReused
)

// Decision is the answer to a Reserve or Peek. A denial reserved nothing,
// and neither did a Conflict (then Allowed is false and States report the
// limits as they are).
type Decision struct {
	Allowed   bool
	Duplicate bool // the same request was admitted before and is open; nothing more was charged
	Conflict  Conflict
	// DeniedBy is the index in States of the first limit that denied, -1 when
	// allowed.
	DeniedBy int
	Reason   Reason
	// RetryAfter is how long until the cost would fit in every denying limit;
	// zero when waiting does not help (see Reason).
	RetryAfter    time.Duration
	Now           time.Time // Redis time of the decision
	Version       int64     // the subject's version after the decision
	TenantVersion int64     // the tenant's version (changes with tenant-wide limits)
	States        []State
}

// ShadowDenied reports whether a shadow limit would have denied.
func (d *Decision) ShadowDenied() bool {
	for i := range d.States {
		if d.States[i].WouldDeny {
			return true
		}
	}
	return false
}

// Reserve checks every rule and, when all allow, reserves the cost in all of
// them and stores a reservation record for RequestID, which names the limits
// it holds (so a settlement gives back exactly those), unless the rules keep
// none (KeepsRecord); when one denies, nothing is reserved. A request id with
// a record charges nothing: it is a Duplicate or a Conflict (see Request).
// It returns ErrNoEpoch when Redis lost its data.
func (l *Limiter) Reserve(ctx context.Context, r Request) (Decision, error) {
	return l.subjectCall(ctx, &r, wire.ModeReserve)
}

// KeepsRecord reports whether Reserve keeps a reservation record for a
// request over rules: only when a settlement would touch one of them (a
// token limit, a balance, a concurrency slot). A reserve over request
// limits alone writes none, since nothing ever corrects, releases or frees
// what it charged: every such Reserve is a new request, counted whatever
// its RequestID, never a Duplicate or a Conflict, and Correct, Release and
// VoidReserve find nothing of it to undo (docs/design.md §4).
func KeepsRecord(rules []policy.Rule) bool { return wire.KeepsRecord(rules) }

// Peek reports the subject's limits without changing anything: it writes
// no key (a concurrency limit's expired slots are left for the next
// reserve to remove). RequestID and Cost are ignored.
func (l *Limiter) Peek(ctx context.Context, r Request) (Decision, error) {
	out := l.PeekBatch(ctx, []Request{r})
	return out[0].Decision, out[0].Err
}

// PeekBatch reports the limits of every subject of rs as Peek does, in
// the pipelined round trip and batched script calls of ReserveBatch,
// without changing anything; the outcomes are in rs's order, and an
// invalid request fails alone. RequestID and Cost are ignored. A reader of
// many subjects' windows (the accounter's usage API) wants it.
func (l *Limiter) PeekBatch(ctx context.Context, rs []Request) []Reserved {
	ps := make([]Request, len(rs))
	for i, r := range rs {
		r.RequestID = "-"
		ps[i] = r
	}
	return l.reserve(ctx, ps, wire.ModePeek)
}

func (l *Limiter) subjectCall(ctx context.Context, r *Request, mode int) (Decision, error) {
	out := l.reserve(ctx, []Request{*r}, mode)
	return out[0].Decision, out[0].Err
}

// ReserveShared checks and reserves cost in the shared limits of one
// endpoint (scope policy.ScopeGlobal, id the endpoint) or one client IP
// (policy.ScopeIP, id the address), all or nothing. Shared limits keep no
// reservation record: give a reservation back with ChargeShared.
func (l *Limiter) ReserveShared(ctx context.Context, scope policy.Scope, id string, cost int64, rules []policy.Rule) (Decision, error) {
	return l.sharedCall(ctx, scope, id, cost, rules, wire.ModeReserve)
}

// PeekShared reports shared limits without changing anything.
func (l *Limiter) PeekShared(ctx context.Context, scope policy.Scope, id string, rules []policy.Rule) (Decision, error) {
	return l.sharedCall(ctx, scope, id, 0, rules, wire.ModePeek)
}

func (l *Limiter) sharedCall(ctx context.Context, scope policy.Scope, id string, cost int64, rules []policy.Rule, mode int) (Decision, error) {
	b := l.p.NewReserveBatch()
	if err := b.AddShared(scope, id, cost, mode, rules); err != nil {
		return Decision{}, err
	}
	c := b.Call()
	var d Decision
	var err error
	wire.DecodeReserves(l.run.Run(ctx, script.Reserve, &c), &c, func(_ int, v wire.ReserveReply, e error) {
		if err = e; err != nil {
			// A failed call's reply holds no states to decode.
			if !errors.Is(err, ErrNoEpoch) {
				err = fmt.Errorf("reserve %s %s: %w", scope, id, err)
			}
			return
		}
		d = decision(v, rules)
	})
	if err != nil {
		return Decision{}, err
	}
	return d, nil
}

// ChargeShared adds amount to the shared limits rules of scope's id, as
// ReserveShared names them: token limits move by amount, request limits
// by 1 in its direction. With a negative amount, admission gives back what
// an earlier layer reserved when a later layer denies. at dates the change
// (zero: Redis's now): a give-back dated at its reservation's
// Decision.Now lands in the rolling bucket that holds it, where one dated
// now, past a bucket's edge, would find nothing to take back. It returns
// the limits after the change.
func (l *Limiter) ChargeShared(ctx context.Context, scope policy.Scope, id string, rules []policy.Rule, amount int64, at time.Time) ([]State, error) {
	c := l.p.ChargeCall("", "", scope, id, rules, amount, at, false)
	if c.Err != nil {
		return nil, c.Err
	}
	return wire.DecodeCharge[State](l.run.Run(ctx, script.Charge, &c), &c)
}

// decision is the Decision of reserve reply v of a reserve over rules.
func decision(v wire.ReserveReply, rules []policy.Rule) Decision {
	d := Decision{
		Allowed:       v.Status == wire.StatusAllowed || v.Status == wire.StatusDuplicate,
		Duplicate:     v.Status == wire.StatusDuplicate,
		Conflict:      conflictOf(v.Status),
		DeniedBy:      int(v.DeniedBy) - 1,
		Now:           time.UnixMilli(v.NowMs),
		Version:       v.Version,
		TenantVersion: v.TenantVersion,
		States:        wire.States[State](v.Limits, rules),
	}
	if v.RetryMs > 0 {
		d.RetryAfter = time.Duration(v.RetryMs) * time.Millisecond
	}
	switch v.Reason {
	case wire.ReasonCostExceedsLimit:
		d.Reason = ReasonCostExceedsLimit
	case wire.ReasonInsufficientBalance:
		d.Reason = ReasonInsufficientBalance
	}
	return d
}

// conflictOf maps a status of a reserve reply to a Decision's Conflict.
func conflictOf(status int64) Conflict {
	switch status {
	case wire.StatusConflictRequest:
		return ConflictRequest
	case wire.StatusConflictSettled:
		return ConflictSettled
	case wire.StatusConflictReused:
		return ConflictReused
	}
	return NoConflict
}

// Fingerprint identifies the request a request id stands for, by its
// endpoint, plan, model and cost (a 48-bit hash, as Request.Fingerprint
// wants): a Reserve of an open reservation's id is a Duplicate only with
// the same fingerprint.
func Fingerprint(endpoint, plan, model string, cost int64) int64 {
	return wire.Fingerprint(endpoint, plan, model, cost)
}
