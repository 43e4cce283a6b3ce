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

// RecordState is the state a restored reservation record says its request
// is in.
type RecordState int

// The states of a restored record (lua/lib.lua).
const (
	// RecordOpen: reserved, not settled; Redis's windows hold its estimate.
	RecordOpen RecordState = iota
	// RecordCorrected: its actual usage was applied.
	RecordCorrected
	// RecordReleased: its estimate was given back; an actual is still
	// charged in full.
	RecordReleased
	// RecordVoid: admitted without Redis, not settled; no window holds it.
	RecordVoid
)

// Restore is a reservation record to put back after Redis lost its data,
// as the accounter's ledger knows it (RestoreMany).
type Restore struct {
	Tenant, User, RequestID string
	State                   RecordState
	// Fingerprint is of the request's endpoint, plan, model and estimate,
	// so that a retry of the same request is a Duplicate again.
	Fingerprint int64
	ReservedAt  time.Time // when its usage counts
	Estimate    int64     // what the windows hold for it while it is open
	// Rules are the rules it was admitted under (as the ledger's plan and
	// endpoint resolve today): what its settlement touches. Only an open
	// or a released record needs them.
	Rules   []Rule
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
func (l *Limiter) RestoreMany(ctx context.Context, rs []Restore) []error {
	calls := make([]call, len(rs))
	now := time.Now()
	for i, r := range rs {
		if err := errors.Join(checkID("tenant", r.Tenant, true), checkID("user", r.User, true),
			checkID("request_id", r.RequestID, true), checkCost("estimate", r.Estimate)); err != nil {
			calls[i].err = err
			continue
		}
		if !r.Expires.After(now) {
			calls[i].err = errSkip
			continue
		}
		keys, _ := subjectKeysOf(newSubjectKeys(r.Tenant, r.User), r.RequestID, r.Rules)
		var head [13]byte
		putInt48(head[0:], r.ReservedAt.UnixMilli())
		putInt48(head[6:], r.Estimate)
		head[12] = byte(r.State)
		rules, conc := r.Rules, keys[4:]
		if r.State == RecordCorrected { // as settle.lua leaves it: no tail
			rules, conc = nil, nil
		}
		rec := string(head[:]) + l.recordTail(r.Fingerprint, 0, rules, conc)
		calls[i] = call{keys: keys[1:2], args: []any{rec, r.Expires.UnixMilli()}}
	}
	cmds := l.runAll(ctx, restoreEntry, calls)
	errs := make([]error, len(rs))
	for i, c := range calls {
		switch {
		case errors.Is(c.err, errSkip):
		case c.err != nil:
			errs[i] = c.err
		default:
			if err := cmds[i].Err(); err != nil {
				errs[i] = fmt.Errorf("restore reservation %s/%s: %w", rs[i].Tenant, rs[i].User, err)
			}
		}
	}
	return errs
}

// errSkip marks a call RestoreMany has no need to make.
var errSkip = errors.New("skip")

// putInt48 writes v as a little-endian 48-bit integer (struct.pack i6).
func putInt48(b []byte, v int64) {
	for k := range 6 {
		b[k] = byte(v >> (8 * k))
	}
}
