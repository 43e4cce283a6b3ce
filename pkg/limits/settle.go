package limits

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
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
	Rules     []Rule
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
	return l.settle(ctx, s, settleCorrect)
}

// Release gives the estimate and the concurrency slots of a reservation
// back, once. Actual is ignored. A reservation already corrected is left
// alone: a release after the actual changes nothing.
func (l *Limiter) Release(ctx context.Context, s Settle) (Settlement, error) {
	return l.settle(ctx, s, settleRelease)
}

// The ops of settle.lua.
const (
	settleCorrect       = 1
	settleRelease       = 2
	settleReleaseIfGone = 3 // release only when Redis holds no record of the id
)

func (l *Limiter) settle(ctx context.Context, s Settle, op int) (Settlement, error) {
	c := l.settleCall(s, op)
	if c.err != nil {
		return Settlement{}, c.err
	}
	return parseSettlement(l.run(ctx, settleEntry, c.keys, c.args...), &c)
}

// settleCall validates s and builds its settle.lua call.
func (l *Limiter) settleCall(s Settle, op int) call {
	if err := errors.Join(
		checkID("tenant", s.Tenant, true),
		checkID("user", s.User, true),
		checkID("request_id", s.RequestID, true),
		checkCost("actual", s.Actual),
	); err != nil {
		return call{err: err}
	}
	rules := settleRules(s.Rules)
	keys, _ := subjectKeysOf(newSubjectKeys(s.Tenant, s.User), s.RequestID, rules)
	fbAt, fbEst := int64(-1), int64(-1)
	if fb := s.Fallback; fb != nil {
		if !fb.ReservedAt.IsZero() {
			fbAt = fb.ReservedAt.UnixMilli()
		}
		fbEst = max(fb.Estimate, NoEstimate)
	}
	return call{
		keys:  keys,
		args:  []any{l.offset, op, s.Actual, l.guard, "", l.resTTL, member(keys), fbAt, fbEst, packSpecs(rules, l.resTTL)},
		rules: rules,
		what:  "settle " + s.Tenant + "/" + s.User,
	}
}

// parseSettlement decodes the reply of settle.lua call c.
func parseSettlement(cmd *redis.Cmd, c *call) (Settlement, error) {
	v, err := packedInts(cmd)
	if err != nil {
		return Settlement{}, fmt.Errorf("%s: %w", c.what, err)
	}
	if len(v) == 1 && v[0] == -1 {
		return Settlement{}, ErrNoEpoch
	}
	const head = 8
	if len(v) != head+4*len(c.rules) {
		return Settlement{}, fmt.Errorf("%s: reply of %d values for %d limits", c.what, len(v), len(c.rules))
	}
	s := Settlement{
		Status:        SettleStatus(v[0]),
		Delta:         v[1],
		ReservedAt:    time.UnixMilli(v[2]),
		Now:           time.UnixMilli(v[3]),
		Version:       v[4],
		TenantVersion: v[5],
		Estimate:      v[7],
		States:        states(v[head:], c.rules),
	}
	if s.Status == AlreadySettled {
		s.ByRelease = v[6] == recordReleased
	}
	return s, nil
}

// recordReleased is the state of a released reservation record (lua/lib.lua).
const recordReleased = 2

// settleRules keeps the rules a settlement touches: token limits and
// concurrency slots.
func settleRules(rules []Rule) []Rule {
	n := 0
	for i := range rules {
		if touchedBySettle(&rules[i]) {
			n++
		}
	}
	if n == len(rules) {
		return rules
	}
	out := make([]Rule, 0, n)
	for i := range rules {
		if touchedBySettle(&rules[i]) {
			out = append(out, rules[i])
		}
	}
	return out
}

func touchedBySettle(r *Rule) bool {
	return r.Unit == Tokens || r.Kind == Concurrency
}

// Charge adds amount (negative gives back) to rules at time at (zero: now),
// without a reservation record. Tenant and user (or, with Shared set, the
// shared scope and id) name the counters. Admission uses it to give back an
// earlier layer's reservation when a later layer denies; the accounter uses
// it with Force to restore windows from its ledger after Redis lost its data.
func (l *Limiter) Charge(ctx context.Context, c ChargeRequest) ([]State, error) {
	cl := l.chargeCall(c)
	if cl.err != nil {
		return nil, cl.err
	}
	return parseCharge(l.run(ctx, chargeEntry, cl.keys, cl.args...), &cl)
}

// chargeCall validates c and builds its charge.lua call.
func (l *Limiter) chargeCall(c ChargeRequest) call {
	if err := checkCost("amount", abs(c.Amount)); err != nil {
		return call{err: err}
	}
	var keys []string
	meta, what := "0", c.SharedID
	if c.SharedScope != "" {
		if err := errors.Join(checkID(string(c.SharedScope), c.SharedID, true), checkShared(c.Rules)); err != nil {
			return call{err: err}
		}
		tag := sharedTag(c.SharedScope, c.SharedID)
		keys = []string{epochKey(tag), sharedBlob(tag)}
	} else {
		if err := errors.Join(checkID("tenant", c.Tenant, true), checkID("user", c.User, true)); err != nil {
			return call{err: err}
		}
		keys, meta = subjectKeysOf(newSubjectKeys(c.Tenant, c.User), "-", c.Rules)
		what = c.Tenant + "/" + c.User
	}
	at := int64(0)
	if !c.At.IsZero() {
		at = c.At.UnixMilli()
	}
	guard := l.guard
	if c.Force {
		guard = "0"
	}
	return call{
		keys:  keys,
		args:  []any{l.offset, c.Amount, at, guard, meta, packSpecs(c.Rules, l.resTTL)},
		rules: c.Rules,
		what:  "charge " + what,
	}
}

// parseCharge decodes the reply of charge.lua call c.
func parseCharge(cmd *redis.Cmd, c *call) ([]State, error) {
	v, err := packedInts(cmd)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", c.what, err)
	}
	if len(v) == 1 && v[0] == -1 {
		return nil, ErrNoEpoch
	}
	if len(v) != 2+4*len(c.rules) {
		return nil, fmt.Errorf("%s: reply of %d values for %d limits", c.what, len(v), len(c.rules))
	}
	return states(v[2:], c.rules), nil
}

// ChargeRequest names the counters and the amount of a Charge.
type ChargeRequest struct {
	Tenant, User string // the subject, or:
	SharedScope  Scope  // ScopeGlobal or ScopeIP, with SharedID the endpoint or address
	SharedID     string
	Rules        []Rule
	Amount       int64     // weighted tokens; requests limits move by 1 in its direction
	At           time.Time // zero: now
	Force        bool      // apply even when the epoch is missing (ledger rebuild)
}

func abs(v int64) int64 {
	if v < 0 {
		return -v
	}
	return v
}
