package limits

import (
	"context"
	_ "embed"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/pkg/ident"
)

//go:embed lua/lib.lua
var luaLib string

//go:embed lua/reserve.lua
var luaReserve string

//go:embed lua/settle.lua
var luaSettle string

//go:embed lua/charge.lua
var luaCharge string

//go:embed lua/lease.lua
var luaLease string

//go:embed lua/topup.lua
var luaTopUp string

//go:embed lua/admitted.lua
var luaAdmitted string

//go:embed lua/void.lua
var luaVoid string

//go:embed lua/restore.lua
var luaRestore string

// admittedScript needs none of the algorithms (script.go has the rest).
var admittedScript = redis.NewScript(luaAdmitted)

// Errors returned by the Limiter. A denial is not an error: it is a Decision
// with Allowed false.
var (
	// ErrNoEpoch means Redis holds no epoch for the slot: it lost its data and
	// the windows have not been rebuilt yet. Nothing was decided or changed;
	// decide locally until the rebuild writes the epoch (WriteEpoch).
	ErrNoEpoch = errors.New("limits: redis has no epoch (lost its data, awaiting rebuild)")
	// ErrInvalid wraps every rejected argument (empty tenant, negative cost...).
	ErrInvalid = errors.New("limits: invalid argument")
)

// MaxID is the longest tenant, user, endpoint, IP, request id or reference,
// in bytes: ident.MaxLen, the one rule every boundary applies.
const MaxID = ident.MaxLen

// MaxCost is the largest cost or amount the engine accepts: counters are
// 48-bit integers in Redis.
const MaxCost = 1_000_000_000_000

// DefaultReservationTTL is how long a reservation lives when nobody settles
// it, unless Options say otherwise: a day, the usage stream's default max
// age, so that an actual event as late as the stream keeps it still finds
// its reservation. Every service's QF_RESERVATION_TTL defaults to it.
const DefaultReservationTTL = 24 * time.Hour

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
}

// Limiter checks and reserves limits in Redis. Every method is one script
// call (one round trip; SettleMany and ChargeMany pipeline many) and is
// safe for concurrent use; all state lives in
// Redis, so any number of Limiters on any number of hosts agree.
//
// Most callers want Reserve before a request and Correct or Release after.
type Limiter struct {
	rdb    Client
	resTTL int64  // ms
	guard  string // "1" when the scripts check the epoch
	offset int64  // ms
	// scriptsOnly is set once the server turned out not to serve functions
	// (script.go).
	scriptsOnly atomic.Bool
	// loads counts the library's loads; loading serializes them, so calls
	// that miss the library together load it once (script.go).
	loads   atomic.Uint64
	loading sync.Mutex
}

// New returns a Limiter over c, which may be a single node, a Sentinel
// failover client or a Redis Cluster client.
func New(c Client, o Options) *Limiter {
	if o.ReservationTTL <= 0 {
		o.ReservationTTL = DefaultReservationTTL
	}
	guard := "1"
	if o.NoEpochGuard {
		guard = "0"
	}
	return &Limiter{
		rdb: c, guard: guard,
		resTTL: o.ReservationTTL.Milliseconds(),
		offset: o.ClockOffset.Milliseconds(),
	}
}

// ReservationTTL is how long a reservation record lives unless it is
// settled (Options.ReservationTTL).
func (l *Limiter) ReservationTTL() time.Duration { return time.Duration(l.resTTL) * time.Millisecond }

// Request is one reservation: Cost weighted tokens for request RequestID of
// (Tenant, User), checked against Rules, the subject's tenant-wide and user
// limits (ScopeTenant and ScopeUser).
//
// RequestID is an idempotency key only while its reservation is open and
// only for the same request, which Fingerprint identifies (see
// Fingerprint): a Reserve of an open reservation's id with the same
// fingerprint is a Duplicate; with another, or of a settled one, a
// Conflict. Fresh asks for a request id no record holds at all
// (ConflictReused otherwise), for callers to whom every call is a new
// request. Nonce tells this call apart from every other Reserve of the id,
// so that VoidReserve can undo exactly this call if its reply is lost;
// zero is fine when the caller never voids.
type Request struct {
	Tenant      string
	User        string
	RequestID   string
	Cost        int64
	Rules       []Rule
	Fingerprint int64
	Nonce       int64
	Fresh       bool
}

// State is one limit after a decision, correction or peek.
type State struct {
	Rule      *Rule // the rule, from the slice the caller passed
	Limit     int64 // the limit; for a balance, the credits topped up so far
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

// checkID applies the identifier rule (package ident) to an argument, so
// that nothing a boundary missed reaches Redis keys, events or the ledger.
func checkID(field, v string, required bool) error {
	if v == "" && required {
		return fmt.Errorf("%w: %s: required", ErrInvalid, field)
	}
	if err := ident.Check(v); err != nil {
		return fmt.Errorf("%w: %s: %w", ErrInvalid, field, err)
	}
	return nil
}

func checkCost(field string, v int64) error {
	if v < 0 || v > MaxCost {
		return fmt.Errorf("%w: %s: must be between 0 and %d", ErrInvalid, field, int64(MaxCost))
	}
	return nil
}

func (r *Request) validate() error {
	return errors.Join(
		checkID("tenant", r.Tenant, true),
		checkID("user", r.User, true),
		checkID("request_id", r.RequestID, true),
		checkCost("cost", r.Cost),
	)
}

// Reserve checks every rule and, when all allow, reserves the cost in all of
// them and stores a reservation record for RequestID, which names the limits
// it holds (so a settlement gives back exactly those); when one denies,
// nothing is reserved. A request id with a record charges nothing: it is a
// Duplicate or a Conflict (see Request). It returns ErrNoEpoch when Redis
// lost its data.
func (l *Limiter) Reserve(ctx context.Context, r Request) (Decision, error) {
	if err := r.validate(); err != nil {
		return Decision{}, err
	}
	return l.subjectCall(ctx, r, 0)
}

// Peek reports the subject's limits without changing anything. RequestID and
// Cost are ignored.
func (l *Limiter) Peek(ctx context.Context, r Request) (Decision, error) {
	r.RequestID = "-"
	if err := r.validate(); err != nil {
		return Decision{}, err
	}
	return l.subjectCall(ctx, r, 1)
}

func (l *Limiter) subjectCall(ctx context.Context, r Request, mode int) (Decision, error) {
	keys, args := l.subjectArgs(&r, mode)
	v, err := packedInts(l.run(ctx, reserveEntry, keys, args...))
	return decodeDecision(v, err, &r)
}

// subjectArgs returns the KEYS and ARGV of a subject call of mode (0
// reserve, 1 peek; a Fresh reserve is mode 2).
func (l *Limiter) subjectArgs(r *Request, mode int) ([]string, []any) {
	keys, meta := subjectKeysOf(newSubjectKeys(r.Tenant, r.User), r.RequestID, r.Rules)
	if mode == 0 && r.Fresh {
		mode = 2
	}
	arg := l.reserveArg(r.Cost, mode, meta, r.Fingerprint, r.Nonce, r.Rules, keys[4:])
	if len(keys) == 4 {
		return keys, []any{arg}
	}
	return keys, []any{arg, member(keys)}
}

// reserveArg is the first argument of a reserve call (lua/reserve.lua): the
// call's scalars, then what its reservation record holds after the state
// byte (recordTail). One argument instead of eight: Redis spends about 1k
// instructions per script argument, and the client one encoding each.
func (l *Limiter) reserveArg(cost int64, mode int, meta string, fingerprint, nonce int64, rules []Rule, conc []string) string {
	var b strings.Builder
	b.Grow(reserveHeadLen + tailLen(rules, conc))
	var h [reserveHeadLen]byte
	putInt48(h[0:], l.offset)
	putInt48(h[6:], cost)
	h[12], h[13], h[14] = byte(mode), l.guard[0]-'0', meta[0]-'0'
	putInt48(h[15:], l.resTTL)
	b.Write(h[:])
	l.writeTail(&b, fingerprint, nonce, rules, conc)
	return b.String()
}

// reserveHeadLen is the size of reserveArg's scalars ('<i6i6BBBi6').
const reserveHeadLen = 21

// mask48 keeps the 48 bits of a fingerprint or nonce that the record holds
// (exact in Lua's doubles).
const mask48 = 1<<48 - 1

// member is the concurrency member of a subject call's request: the
// reservation record's key after its tag, unique per (user, request id), so
// two users of a tenant never share a slot of a tenant-wide limit.
func member(keys []string) string {
	rec := keys[1]
	return rec[strings.Index(rec, "}r:")+3:]
}

// recordTail is a reservation record after its state byte (lua/lib.lua):
// the request's fingerprint and the call's nonce, the count and the packed
// specs of rules, then conc, the sorted set key of each concurrency limit
// among them (as subjectKeysOf built them for rules).
func (l *Limiter) recordTail(fingerprint, nonce int64, rules []Rule, conc []string) string {
	var b strings.Builder
	b.Grow(tailLen(rules, conc))
	l.writeTail(&b, fingerprint, nonce, rules, conc)
	return b.String()
}

func tailLen(rules []Rule, conc []string) int {
	n := 14 + specLen*len(rules)
	for _, k := range conc {
		n += 2 + len(k)
	}
	return n
}

func (l *Limiter) writeTail(b *strings.Builder, fingerprint, nonce int64, rules []Rule, conc []string) {
	var n [14]byte
	putInt48(n[0:], fingerprint&mask48)
	putInt48(n[6:], nonce&mask48)
	binary.LittleEndian.PutUint16(n[12:], uint16(len(rules)))
	b.Write(n[:])
	writeSpecs(b, rules, l.resTTL)
	for _, k := range conc {
		b.Write(binary.LittleEndian.AppendUint16(n[:0], uint16(len(k))))
		b.WriteString(k)
	}
}

// decodeDecision reads the reply (or error) of a subject call of r.
func decodeDecision(v []int64, err error, r *Request) (Decision, error) {
	d, err := decodeReply(v, err, r.Rules)
	if err != nil && !errors.Is(err, ErrNoEpoch) {
		err = fmt.Errorf("reserve %s/%s: %w", r.Tenant, r.User, err)
	}
	return d, err
}

// subjectKeysOf returns the KEYS of a subject call (lua/lib.lua): the epoch,
// the reservation record, the subject and tenant blobs, then one sorted set
// per concurrency limit; and the meta argument saying whether the tenant
// blob is involved.
func subjectKeysOf(k subjectKeys, requestID string, rules []Rule) ([]string, string) {
	keys := make([]string, 0, 4+len(rules))
	keys = append(keys, epochKey(k.tag()), k.reservation(requestID), k.blob(), k.tenantBlob())
	meta := "1"
	for i := range rules {
		if rules[i].Scope == ScopeTenant {
			meta = "2"
		}
		if rules[i].Kind == Concurrency {
			keys = append(keys, k.concurrency(&rules[i]))
		}
	}
	return keys, meta
}

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

// tombTTL is how long the marker of a voided call that was denied stops
// that call: a script call that has not reached Redis a minute after it was
// sent never will (its connection was closed when its deadline passed).
const tombTTL = time.Minute

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
	calls := make([]call, len(vs))
	for i, v := range vs {
		if err := errors.Join(checkID("tenant", v.Tenant, true), checkID("user", v.User, true), checkID("request_id", v.RequestID, true)); err != nil {
			calls[i].err = err
			continue
		}
		keys, _ := subjectKeysOf(newSubjectKeys(v.Tenant, v.User), v.RequestID, nil)
		allowed := "0"
		if v.Allowed {
			allowed = "1"
		}
		calls[i] = call{keys: keys, args: []any{l.offset, l.guard, allowed, v.Fingerprint & mask48, v.Nonce & mask48,
			l.resTTL, member(keys), tombTTL.Milliseconds()}}
	}
	cmds := l.runAll(ctx, voidEntry, calls)
	out := make([]VoidResult, len(vs))
	for i, c := range calls {
		if c.err != nil {
			out[i].Err = c.err
			continue
		}
		n, err := cmds[i].Int64()
		switch {
		case err != nil:
			out[i].Err = fmt.Errorf("void reserve %s/%s: %w", vs[i].Tenant, vs[i].User, err)
		case n == -1:
			out[i].Err = ErrNoEpoch
		default:
			out[i].Status = VoidStatus(n)
		}
	}
	return out
}

// Admitted reports whether request id of (tenant, user) has a reservation
// record, i.e. was admitted (and possibly settled) within ReservationTTL.
// Admission asks it when a shared layer denies a request whose id the
// caller chose: a retry of an admitted request gets its stored decision,
// never a denial by a layer it already passed.
func (l *Limiter) Admitted(ctx context.Context, tenant, user, requestID string) (bool, error) {
	if err := errors.Join(checkID("tenant", tenant, true), checkID("user", user, true), checkID("request_id", requestID, true)); err != nil {
		return false, err
	}
	n, err := admittedScript.Run(ctx, l.rdb, []string{newSubjectKeys(tenant, user).reservation(requestID)}).Int64()
	if err != nil {
		return false, fmt.Errorf("admitted %s/%s: %w", tenant, user, err)
	}
	return n == 1, nil
}

// ReserveShared checks and reserves cost in the shared limits of one
// endpoint (scope ScopeGlobal, id the endpoint) or one client IP (ScopeIP,
// id the address), all or nothing. Shared limits keep no reservation
// record: give a reservation back with Charge and a negative amount.
func (l *Limiter) ReserveShared(ctx context.Context, scope Scope, id string, cost int64, rules []Rule) (Decision, error) {
	return l.sharedCall(ctx, scope, id, cost, rules, 0)
}

// PeekShared reports shared limits without changing anything.
func (l *Limiter) PeekShared(ctx context.Context, scope Scope, id string, rules []Rule) (Decision, error) {
	return l.sharedCall(ctx, scope, id, 0, rules, 1)
}

func (l *Limiter) sharedCall(ctx context.Context, scope Scope, id string, cost int64, rules []Rule, mode int) (Decision, error) {
	if err := errors.Join(checkID(string(scope), id, true), checkCost("cost", cost), checkShared(rules)); err != nil {
		return Decision{}, err
	}
	tag := sharedTag(scope, id)
	arg := l.reserveArg(cost, mode, "0", 0, 0, rules, nil)
	v, err := packedInts(l.run(ctx, reserveEntry, []string{epochKey(tag), sharedBlob(tag)}, arg))
	d, err := decodeReply(v, err, rules)
	if err != nil && !errors.Is(err, ErrNoEpoch) {
		err = fmt.Errorf("reserve %s %s: %w", scope, id, err)
	}
	return d, err
}

// checkShared rejects limits that need a subject: a shared scope keeps no
// reservation record, so it has no concurrency slots or balances.
func checkShared(rules []Rule) error {
	for i := range rules {
		if k := rules[i].Kind; k == Concurrency || k == Balance {
			return fmt.Errorf("%w: %s: a %s limit needs a subject, not a shared scope", ErrInvalid, rules[i].Name, k)
		}
	}
	return nil
}

// decodeReply reads the reply of the reserve script (lua/reserve.lua) or
// the error of its call. Errors other than ErrNoEpoch are the caller's to
// wrap with what it called, so the success path formats nothing.
func decodeReply(v []int64, err error, rules []Rule) (Decision, error) {
	if err != nil {
		return Decision{}, err
	}
	if len(v) == 1 && v[0] == -1 {
		return Decision{}, ErrNoEpoch
	}
	const head = 7
	if len(v) != head+4*len(rules) {
		return Decision{}, fmt.Errorf("reply of %d values for %d limits", len(v), len(rules))
	}
	d := Decision{
		Allowed:       v[0] == 1 || v[0] == 2,
		Duplicate:     v[0] == 2,
		Conflict:      conflictOf(v[0]),
		DeniedBy:      int(v[1]) - 1,
		Now:           time.UnixMilli(v[4]),
		Version:       v[5],
		TenantVersion: v[6],
		States:        states(v[head:], rules),
	}
	if v[2] > 0 {
		d.RetryAfter = time.Duration(v[2]) * time.Millisecond
	}
	switch v[3] {
	case 1:
		d.Reason = ReasonCostExceedsLimit
	case 2:
		d.Reason = ReasonInsufficientBalance
	}
	return d, nil
}

// conflictOf maps a status of the reserve script to a Decision's Conflict.
func conflictOf(status int64) Conflict {
	switch status {
	case 3:
		return ConflictRequest
	case 4:
		return ConflictSettled
	case 5:
		return ConflictReused
	}
	return NoConflict
}

// packedInts reads the reply of a script that answers with snapshot
// (lua/lib.lua): 64-bit little-endian integers packed in one string, which
// the client reads in one piece where an array reply costs a read and an
// allocation per value.
func packedInts(cmd *redis.Cmd) ([]int64, error) {
	s, err := cmd.Text()
	if err != nil {
		return nil, err
	}
	if len(s)%8 != 0 {
		return nil, fmt.Errorf("reply of %d bytes is not a list of 64-bit integers", len(s))
	}
	v := make([]int64, len(s)/8)
	for i := range v {
		v[i] = int64(binary.LittleEndian.Uint64([]byte(s[8*i : 8*i+8])))
	}
	return v, nil
}

// states decodes the 4 reply values per limit: limit, used, reset ms, flag.
// Counts are held to [0, MaxCost], as the scripts saturate them, so that
// no snapshot of state an older release left can break the event contract.
func states(v []int64, rules []Rule) []State {
	out := make([]State, len(rules))
	for i := range out {
		w := v[4*i : 4*i+4]
		lim, used := min(max(w[0], 0), MaxCost), min(max(w[1], 0), MaxCost)
		out[i] = State{
			Rule: &rules[i], Limit: lim, Used: used, Remaining: max(0, lim-used),
			Reset: time.Duration(w[2]) * time.Millisecond, WouldDeny: w[3] == 1,
		}
	}
	return out
}

// Kind codes shared with lua/lib.lua.
var kindCode = map[Kind]int{
	Rolling: 1, Fixed: 2, CalendarMonth: 3, TokenBucket: 4, SlidingLog: 5, Balance: 6, Concurrency: 7,
}

// specLen is the size in bytes of one packed limit spec (lua/lib.lua).
const specLen = 32

// buckets returns the bucket count of a rolling window.
func buckets(r *Rule) int {
	if r.Buckets > 0 {
		return r.Buckets
	}
	return DefaultBuckets
}

// packSpecs packs every rule into the one string argument the scripts
// decode (lua/lib.lua: '<I6BBddd' per limit). One argument instead of eight
// per limit: Redis spends about 1k instructions per script argument.
func packSpecs(rules []Rule, slotTTL int64) string {
	var b strings.Builder // one allocation: String does not copy
	b.Grow(specLen * len(rules))
	writeSpecs(&b, rules, slotTTL)
	return b.String()
}

// writeSpecs writes the packed spec of every rule to b.
func writeSpecs(b *strings.Builder, rules []Rule, slotTTL int64) {
	var w [specLen]byte
	for i := range rules {
		r := &rules[i]
		var flags byte
		if r.Unit == Tokens {
			flags |= 1
		}
		if r.Shadow {
			flags |= 2
		}
		if r.Scope == ScopeTenant {
			flags |= 4
		}
		limit, a, c := float64(r.Limit.Limit), 0.0, 0.0
		switch r.Kind {
		case Rolling:
			n := int64(buckets(r))
			a, c = float64(time.Duration(r.Window).Milliseconds()/n), float64(n)
		case Fixed, SlidingLog:
			a = float64(time.Duration(r.Window).Milliseconds())
		case TokenBucket:
			limit = float64(r.Burst)
			a = r.Rate / float64(time.Duration(r.Per).Milliseconds())
			c = float64(time.Duration(r.Per).Milliseconds())
		case Concurrency:
			a = float64(slotTTL)
		}
		id := uint64(ruleID(r))
		for k := range 6 {
			w[k] = byte(id >> (8 * k))
		}
		w[6], w[7] = byte(kindCode[r.Kind]), flags
		binary.LittleEndian.PutUint64(w[8:], math.Float64bits(limit))
		binary.LittleEndian.PutUint64(w[16:], math.Float64bits(a))
		binary.LittleEndian.PutUint64(w[24:], math.Float64bits(c))
		b.Write(w[:])
	}
}
