// Package wire is the Go side of the protocol between the limits engine and
// its Lua (../script/lua/*.lua): the keys of every call (keys.go), what each
// call sends, what it gets back, and the records the scripts keep in Redis
// (this file, which documents all of it). The Lua side is lib.lua (formats,
// algorithms) and one file per entry. Package limits and package repair
// build their calls here and script runs them.
//
// Integers are little-endian; i6 and I6 are signed and unsigned 48-bit
// integers (exact in Lua's doubles, ±1.4e14, where counters cap at MaxCost),
// d a float64, as struct.pack spells them.
//
// # Calls
//
// Every call carries the clock offset (ms added to Redis TIME, 0 outside
// tests) and the guard ("1": answer "no epoch" instead of deciding when the
// slot's epoch key is missing) except where noted. KEYS of a subject call
// are the slot's epoch key, the reservation record, the subject blob, the
// tenant blob, then one sorted set per concurrency limit in spec order
// (subjectCallKeys); of a shared call, the epoch key and the scope's blob.
// "no epoch" is the reply -1, as a packed or plain integer or {-1}.
//
//	entry     ARGV                                              reply
//	reserve   1 batch head; 2 record ttl ms; then one reserve    per reserve, in order: its
//	          argument per reserve of the batch (KEYS: all      snapshot (status, denied_by,
//	          the batch's keys, each once)                      retry_ms, reason, now_ms,
//	                                                            version, tenant_version), the
//	                                                            packed -1, or an error
//	settle    offset, op, actual, guard, "", record ttl ms,      snapshot: status, delta,
//	          member, fallback time ms, fallback estimate,       reserved_at_ms, now_ms, version,
//	          specs (token and concurrency limits)               tenant_version, prior state, estimate
//	charge    offset, amount, time ms (0: now), guard, meta,     snapshot: status, now_ms
//	          specs
//	lease     offset, op (1 lease, 2 give back), amount, guard,  {granted, window_id, expires_ms,
//	          window id (give back), spec                        now_ms, limit, used, reset_ms}
//	topup     amount, marker ttl ms, guard, spec (no offset)     {status, credited, spent, version}
//	void      offset, guard, allowed ("1"/"0"), fingerprint,     status
//	          nonce, record ttl ms, member, tombstone ttl ms
//	restore   record, expiry (Unix ms); KEYS the record alone    1 restored, 0 a record was there
//	windows   offset; KEYS subject blob, tenant blob             {now_ms, subject blob, tenant blob}
//	admitted  none; KEYS the record alone                        1 exists, 0 not
//
// Each .lua file's header states what its entry guarantees and what its
// statuses mean; the constants below name them for Go, and LuaNames gives
// the same numbers to the Lua, which writes them as names.
//
// # Specs
//
// The limits of a call travel packed in one string, 32 bytes each,
// '<I6BBddd': id (ruleID), kind (1 rolling, 2 fixed, 3 calendar_month,
// 4 token_bucket, 5 sliding_log, 6 balance, 7 concurrency), flags (1 counts
// tokens, 2 shadow, 4 lives in the tenant blob), limit (token_bucket: its
// burst), a, b. a is a rolling window's bucket length ms; a fixed or
// sliding_log window ms; a token bucket's refill per ms (0: an allowance);
// a concurrency slot's ttl ms. b is a rolling window's bucket count, or a
// token bucket's period ms. One argument, where eight per limit cost Redis
// about 1k instructions each.
//
// # Reserve calls
//
// One reserve call decides a batch of reserves in order (ReserveBatch; a
// lone Reserve is a batch of one), so Redis pays a call's fixed cost once
// per batch. KEYS are every key its reserves name, each once: the strings
// first (epoch keys, records, blobs), which the script reads in one MGET,
// then the concurrency sets. The batch head, '<i6BI2': offset, flags (1:
// guard; 2: decide each reserve or settle the fast path takes on the
// general path too and fail on any difference, for tests: lib.lua's fast),
// how many KEYS are strings. Each reserve's argument, '<i6BBI2I2I2I2': cost
// (weighted tokens; a requests limit charges 1), mode (ModeReserve,
// ModePeek, ModeFresh: a request id no record may hold), meta (0 shared, 1
// subject, 2 subject with tenant-wide limits), the KEYS indexes of its
// epoch key, record (0: none: a shared reserve, or a reserve over rules
// that keep no record, KeepsRecord), blob and tenant blob (0: none);
// then, from
// byte 17, what the reservation record holds after its state byte: the
// record tail; then, with concurrency limits, the concurrency member.
//
// # Snapshot replies
//
// reserve, settle and charge answer with 64-bit integers packed in one
// string (lib.lua snapshot): the head values above, then per limit of the
// call its used and reset ms, then a balance's credited, then a shadow
// limit's would deny (1: it did not fit); every other limit is the spec's,
// which Go sent (limitValues). One bulk string costs the client one read
// where an array costs one per value.
//
// # Reservation record
//
// KEYS[2] of a subject call (a reserve over rules that keep none,
// KeepsRecord, names no record: its argument's record index is 0),
// '<i6i6BI6I6': time ms, estimate, state
// (RecordOpen, RecordCorrected, RecordReleased, RecordVoid, and recordTomb:
// the marker of a locally denied call whose Reserve was lost), the request's
// fingerprint, the nonce of the Reserve that wrote it; then the tail: I2
// count m, the m specs of the limits the reserve charged, then for each
// concurrency limit among them its sorted set's key (I2 length, bytes). A
// settlement touches exactly what the tail names, whatever the policy says
// by then. A corrected record keeps no tail; one of 13 bytes ('<i6i6B'),
// left by an earlier release, has no fingerprint or nonce either.
//
// # Blobs
//
// The state of all limits of one scope is one string: a version (d), then
// one record per limit: id (I6), expiry ms (i6, 2^47-1 for never), payload
// length (I2), payload. Payloads, in i6 unless said:
//
//	rolling       head bucket, tail (oldest non-empty bucket), total, then
//	              n counters as a ring (bucket j at index j % n)
//	fixed         window number, count
//	calendar      month number (year*12 + month - 1), count
//	token_bucket  tokens, last refill ms (d, d); rate 0: used, period start
//	sliding_log   one ms timestamp per admitted request, oldest first
//	balance       credited, spent
//
// A concurrency limit is a sorted set of its own (member: the request's
// record key after its tag; score: expiry). Records past their expiry count
// as absent. Windows decodes rolling, fixed and calendar payloads here
// (DecodeWindows); everything else only Lua reads.
package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/pkg/limits/policy"
)

// Params are what every call of one Limiter sends besides its own
// arguments.
type Params struct {
	offset int64  // ms added to Redis time
	guard  string // "1" when the scripts check the epoch
	resTTL int64  // ms a reservation record and a concurrency slot live
	check  byte   // 2 when reserve and settle calls check their fast path (tests)
}

// DefaultReservationTTL is limits.DefaultReservationTTL: a day.
const DefaultReservationTTL = 24 * time.Hour

// NewParams returns the Params of limits.Options: its ReservationTTL
// (DefaultReservationTTL when zero), NoEpochGuard and ClockOffset.
func NewParams(reservationTTL time.Duration, noEpochGuard bool, clockOffset time.Duration) Params {
	if reservationTTL <= 0 {
		reservationTTL = DefaultReservationTTL
	}
	guard := "1"
	if noEpochGuard {
		guard = "0"
	}
	return Params{offset: clockOffset.Milliseconds(), guard: guard, resTTL: reservationTTL.Milliseconds()}
}

// CheckingFast returns p with reserve and settle calls that decide every
// entry their fast path takes on the general path too, and fail on any
// difference: for tests, which so compare the two within one call, at one
// Redis time.
func (p Params) CheckingFast() Params {
	p.check = 2
	return p
}

// ReservationTTL is how long a reservation record lives unless settled.
func (p Params) ReservationTTL() time.Duration { return time.Duration(p.resTTL) * time.Millisecond }

// Call is one prepared call of an entry: its KEYS and ARGV, the rules its
// reply reports on, in order, and what names it in errors. Err, when set,
// rejected its arguments: it is not sent.
type Call struct {
	Keys  []string
	Args  []any
	Rules []policy.Rule
	// Batch holds the rules of each reserve of a reserve call, in order.
	Batch [][]policy.Rule
	What  string
	Err   error
}

// invalid is a Call rejected with err.
func invalid(err error) Call { return Call{Err: err} }

// The modes of a reserve call.
const (
	ModeReserve = 0
	ModePeek    = 1
	ModeFresh   = 2 // reserve a request id that no record holds
)

// General, added to a reserve's mode or a settle's op, decides the entry on
// the engine's general path even where its fast path would take it: for
// tests that compare the two (lib.lua's fast).
const General = 4

// The statuses of a reserve reply.
const (
	StatusDenied          = 0
	StatusAllowed         = 1
	StatusDuplicate       = 2 // the same open request: nothing charged
	StatusConflictRequest = 3 // the id's open reservation has another fingerprint
	StatusConflictSettled = 4 // the id's reservation was settled or released
	StatusConflictReused  = 5 // ModeFresh and the id has a record
)

// The reasons of a reserve reply.
const (
	ReasonCostExceedsLimit    = 1
	ReasonInsufficientBalance = 2
)

// The ops of a settle call.
const (
	SettleCorrect       = 1
	SettleRelease       = 2
	SettleReleaseIfGone = 3 // release only when Redis holds no record of the id
)

// The states of a reservation record (lib.lua).
const (
	RecordOpen      = 0
	RecordCorrected = 1
	RecordReleased  = 2
	RecordVoid      = 3
	recordTomb      = 4 // a locally denied call's marker (void.lua); never restored
)

// recordHeadLen is the size of a reservation record before its
// fingerprint: time, estimate, state ('<i6i6B'), all of a record of an
// earlier release.
const recordHeadLen = 13

// tailHeadLen is the size of a record tail before its specs: fingerprint,
// nonce, spec count ('<I6I6I2').
const tailHeadLen = 14

// mask48 keeps the 48 bits of a fingerprint or nonce that the record holds
// (exact in Lua's doubles).
const mask48 = 1<<48 - 1

// reserveHeadLen is the size of a reserve's scalars ('<i6BBI2I2I2I2').
const reserveHeadLen = 16

// batchHeadLen is the size of a reserve or settle call's first argument
// ('<i6BI2').
const batchHeadLen = 9

// settleHeadLen is the size of a settle's scalars ('<Bi6i6i6I2I2I2I2I2I2').
const settleHeadLen = 31

// MaxBatch is the most reserves one reserve call carries, or settles one
// settle call; callers start another call past it. A function runs
// atomically, so a call holds the node for all its entries: 64 of about
// 10-20 µs each.
const MaxBatch = 64

// specLen is the size in bytes of one packed spec.
const specLen = 32

// kindCode is the kind byte of a spec.
var kindCode = map[policy.Kind]byte{
	policy.Rolling: 1, policy.Fixed: 2, policy.CalendarMonth: 3, policy.TokenBucket: 4,
	policy.SlidingLog: 5, policy.Balance: 6, policy.Concurrency: 7,
}

// The bits of a spec's flags byte.
const (
	flagTokens = 1 // the limit counts tokens, not requests
	flagShadow = 2 // it reports but never denies
	flagTenant = 4 // it lives in the tenant blob
)

// LuaNames are the numbers above as the Lua code names them: package
// script writes each in for its name when it assembles the engine, so the
// two sides of the protocol read them from this one table.
var LuaNames = map[string]int64{
	"ROLLING":                 int64(kindCode[policy.Rolling]),
	"FIXED":                   int64(kindCode[policy.Fixed]),
	"CALENDAR":                int64(kindCode[policy.CalendarMonth]),
	"TOKEN_BUCKET":            int64(kindCode[policy.TokenBucket]),
	"SLIDING_LOG":             int64(kindCode[policy.SlidingLog]),
	"BALANCE":                 int64(kindCode[policy.Balance]),
	"CONCURRENCY":             int64(kindCode[policy.Concurrency]),
	"MODE_PEEK":               ModePeek,
	"MODE_FRESH":              ModeFresh,
	"GENERAL":                 General,
	"STATUS_DENIED":           StatusDenied,
	"STATUS_ALLOWED":          StatusAllowed,
	"STATUS_DUPLICATE":        StatusDuplicate,
	"STATUS_CONFLICT_REQUEST": StatusConflictRequest,
	"STATUS_CONFLICT_SETTLED": StatusConflictSettled,
	"STATUS_CONFLICT_REUSED":  StatusConflictReused,
	"REASON_EXCEEDS_LIMIT":    ReasonCostExceedsLimit,
	"REASON_NO_BALANCE":       ReasonInsufficientBalance,
	"OPEN":                    RecordOpen,
	"CORRECTED":               RecordCorrected,
	"RELEASED":                RecordReleased,
	"VOID":                    RecordVoid,
	"TOMB":                    recordTomb,
	"SPEC_LEN":                specLen,
	"RESERVE_HEAD":            reserveHeadLen,
	"SETTLE_HEAD":             settleHeadLen,
	"RECORD_HEAD":             recordHeadLen,
	"TAIL_HEAD":               tailHeadLen,
	"MAX_COUNT":               MaxCost,
	"COUNTER_LEN":             counterLen,
}

// LuaFlags are the bits of a spec's flags byte that the Lua code tests as
// IS_<name>(flags).
var LuaFlags = map[string]int64{"TOKENS": flagTokens, "SHADOW": flagShadow, "TENANT": flagTenant}

// tombTTL is how long the marker of a voided call that was denied stops
// that call: a script call that has not reached Redis a minute after it was
// sent never will (its connection was closed when its deadline passed).
const tombTTL = time.Minute

// topUpMarkerTTL is how long a top-up reference is remembered in Redis, so a
// retried top-up applies once. The ledger remembers it for ever.
const topUpMarkerTTL = 400 * 24 * 3600 * 1000 // ms

// ReserveBatch gathers reserves into one reserve call (reserve.lua): the
// keys they name, each once (a key twice would let a reserve read what an
// earlier one of the call replaced), and one argument per reserve. On a
// Redis Cluster the keys of one call must share a slot, as every key of a
// tenant or of a shared scope's id does: callers batch per slot there.
// Build it with Params.NewReserveBatch.
type ReserveBatch struct {
	batch
}

// batch is what a reserve or a settle call gathers: the keys its entries
// name, each once (a key twice would let an entry read what an earlier one
// of the call replaced), and one argument per entry.
type batch struct {
	p     Params
	strs  []string // string keys, read in one MGET
	zsets []string // concurrency sets, after them
	index map[string]int
	args  []any // the head and the ttl, then one argument per entry (add)
	// entries holds the latest entries' arguments, which args points into:
	// go-redis writes a *string as the string (fcallCmd passes keys so too),
	// where boxing each string in an interface value was an allocation an
	// entry. A full chunk is left as it is (args points into it) for a new
	// one, never copied.
	entries []string
	rules   [][]policy.Rule
}

// entryChunk is how many entries' arguments an allocation holds: a batch
// at 16 connections is about 7 entries, at 64 about 25.
const entryChunk = 4

// add appends an entry's argument.
func (b *batch) add(arg string) {
	if len(b.entries) == cap(b.entries) {
		b.entries = make([]string, 0, entryChunk)
	}
	b.entries = append(b.entries, arg)
	b.args = append(b.args, &b.entries[len(b.entries)-1])
}

// NewReserveBatch returns an empty batch.
func (p Params) NewReserveBatch() *ReserveBatch {
	return &ReserveBatch{p.newBatch()}
}

func (p Params) newBatch() batch { return batch{p: p, args: make([]any, 2, 3)} }

// Len is the number of entries in b.
func (b *batch) Len() int { return len(b.rules) }

// Add adds the reserve of mode of a request of (tenant, user): cost for
// requestID, under rules, with the request's fingerprint and the call's
// nonce. It checks the identifiers and the cost and adds nothing when they
// fail.
func (b *ReserveBatch) Add(tenant, user, requestID string, cost int64, mode int, fingerprint, nonce int64, rules []policy.Rule) error {
	if err := CheckSubjectCall(tenant, user, requestID, cost); err != nil {
		return err
	}
	rid := requestID
	if !KeepsRecord(rules) {
		rid = ""
	}
	keys, meta := subjectCallKeys(NewSubjectKeys(tenant, user), rid, rules)
	conc := keys[4:]
	var rk, tk int
	if rid != "" {
		rk = b.key(keys[1])
	}
	if meta == 2 {
		tk = b.key(keys[3])
	}
	head := reserveHead(cost, mode, meta, b.key(keys[0]), rk, b.key(keys[2]), tk)
	n := reserveHeadLen + tailLen(rules, conc)
	var mem string
	if len(conc) > 0 {
		mem = member(keys)
		n += len(mem)
		for _, k := range conc {
			b.zset(k)
		}
	}
	var w strings.Builder
	w.Grow(n)
	w.Write(head[:])
	b.p.writeTail(&w, fingerprint, nonce, rules, conc)
	w.WriteString(mem)
	b.add(w.String())
	b.rules = append(b.rules, rules)
	return nil
}

// AddShared adds the reserve of mode of cost in the shared limits rules of
// scope's id.
func (b *ReserveBatch) AddShared(scope policy.Scope, id string, cost int64, mode int, rules []policy.Rule) error {
	if err := errors.Join(checkID(string(scope), id, true), checkCost("cost", cost), checkShared(rules)); err != nil {
		return err
	}
	tag := sharedTag(scope, id)
	head := reserveHead(cost, mode, 0, b.key(epochKey(tag)), 0, b.key(sharedBlob(tag)), 0)
	var w strings.Builder
	w.Grow(reserveHeadLen + tailLen(rules, nil))
	w.Write(head[:])
	b.p.writeTail(&w, 0, 0, rules, nil)
	b.add(w.String())
	b.rules = append(b.rules, rules)
	return nil
}

// reserveHead packs a reserve's scalars: its cost, mode and meta byte and
// the KEYS indexes of its epoch key, record, blob and tenant blob.
func reserveHead(cost int64, mode int, meta byte, ek, rk, sk, tk int) (h [reserveHeadLen]byte) {
	putInt48(h[0:], cost)
	h[6], h[7] = byte(mode), meta
	binary.LittleEndian.PutUint16(h[8:], uint16(ek))
	binary.LittleEndian.PutUint16(h[10:], uint16(rk))
	binary.LittleEndian.PutUint16(h[12:], uint16(sk))
	binary.LittleEndian.PutUint16(h[14:], uint16(tk))
	return h
}

// key returns the 1-based KEYS index of string key k, adding it once.
// Lone calls name four keys: a scan costs less than a map until a batch
// names a few dozen. The map starts at twice the keys so far and grows
// with the batch: sized for the largest batch (4 × MaxBatch keys), it
// was some 6 KiB for each batch of a few requests.
func (b *batch) key(k string) int {
	if b.index != nil {
		if i, ok := b.index[k]; ok {
			return i
		}
	} else {
		for i, s := range b.strs {
			if s == k {
				return i + 1
			}
		}
		if len(b.strs) >= 16 {
			b.index = make(map[string]int, 2*len(b.strs))
			for i, s := range b.strs {
				b.index[s] = i + 1
			}
		}
	}
	b.strs = append(b.strs, k)
	if b.index != nil {
		b.index[k] = len(b.strs)
	}
	return len(b.strs)
}

// Keys is the number of string keys b names.
func (b *batch) Keys() int { return len(b.strs) }

// zset adds concurrency set k to the keys once: the scripts name it by the
// copy in their argument, so it only needs declaring.
func (b *batch) zset(k string) {
	for _, s := range b.zsets {
		if s == k {
			return
		}
	}
	b.zsets = append(b.zsets, k)
}

// Call returns the call of b's entries, Batch their rules.
func (b *batch) Call() Call { return b.call(0) }

// Call returns the call of b's reserves, Batch their rules.
func (b *ReserveBatch) Call() Call { return b.call(b.p.check) }

// Call returns the call of b's settles, Batch their rules.
func (b *SettleBatch) Call() Call { return b.call(b.p.check) }

// call returns the call of b's entries with flags added to the head's.
func (b *batch) call(flags byte) Call {
	var h [batchHeadLen]byte
	putInt48(h[0:], b.p.offset)
	h[6] = b.p.guard[0] - '0' | flags
	binary.LittleEndian.PutUint16(h[7:], uint16(len(b.strs)))
	b.args[0], b.args[1] = string(h[:]), strconv.FormatInt(b.p.resTTL, 10)
	keys := b.strs
	if len(b.zsets) > 0 {
		keys = append(keys[:len(keys):len(keys)], b.zsets...)
	}
	return Call{Keys: keys, Args: b.args, Batch: b.rules}
}

// ReserveReply is one decoded reserve of a reserve reply.
type ReserveReply struct {
	Status, DeniedBy, RetryMs, Reason, NowMs, Version, TenantVersion int64
	// Limits holds the values of its limits; States decodes them.
	Limits []int64
}

// DecodeReserves reads the reply of reserve call c and passes f each
// reserve's reply or error, in the order of c.Batch. An error of the whole
// call (the connection, a script error) is every reserve's. Errors other
// than ErrNoEpoch are the caller's to wrap with what it reserved, so the
// success path formats nothing. v.Limits is f's to read until it returns:
// one array holds each reserve's values in turn (an allocation a reserve
// fewer).
func DecodeReserves(cmd *redis.Cmd, c *Call, f func(i int, v ReserveReply, err error)) {
	var buf []int64
	decodeBatch(cmd, c, func(i int, e any) {
		v, err := packedElement(buf[:0], e, 7, c.Batch[i])
		buf = v[:0]
		if err != nil {
			f(i, ReserveReply{}, err)
			return
		}
		f(i, ReserveReply{
			Status: v[0], DeniedBy: v[1], RetryMs: v[2], Reason: v[3],
			NowMs: v[4], Version: v[5], TenantVersion: v[6], Limits: v[7:],
		}, nil)
	}, func(i int, err error) { f(i, ReserveReply{}, err) })
}

// decodeBatch reads the reply of batch call c: it passes each entry's
// element of the reply to one, in the order of c.Batch, or, when the
// whole call failed (the connection, a script error), the error to fail.
func decodeBatch(cmd *redis.Cmd, c *Call, one func(i int, e any), fail func(i int, err error)) {
	all, err := cmd.Slice()
	if err == nil && len(all) != len(c.Batch) {
		err = fmt.Errorf("reply of %d entries for %d", len(all), len(c.Batch))
	}
	for i := range c.Batch {
		if err != nil {
			fail(i, err)
			continue
		}
		one(i, all[i])
	}
}

// packedElement reads one entry's element of a batch reply, a snapshot
// with head values before those of rules, into dst's array when it has
// room.
func packedElement(dst []int64, e any, head int, rules []policy.Rule) ([]int64, error) {
	var s string
	switch e := e.(type) {
	case string:
		s = e
	case error:
		return nil, e
	default:
		return nil, fmt.Errorf("reply element is %T", e)
	}
	v, err := unpackInts(dst, s)
	if err != nil {
		return nil, err
	}
	if len(v) == 1 && v[0] == -1 {
		return nil, ErrNoEpoch
	}
	if len(v) != head+limitValues(rules) {
		return nil, fmt.Errorf("reply of %d values for %d limits", len(v), len(rules))
	}
	return v, nil
}

// state is the shape of limits.State, which States fills: this package
// cannot name limits.State (limits imports it), and a constraint on the
// shape lets it build the engine's type without a copy.
type state interface {
	~struct {
		Rule      *policy.Rule
		Limit     int64
		Used      int64
		Remaining int64
		Reset     time.Duration
		WouldDeny bool
	}
}

// limitValues is how many values a snapshot holds for rules: used and
// reset ms per limit, then a balance's credited and a shadow limit's
// would-deny flag (1: it did not fit). The limit of every other kind is its
// spec's, which Go knows: packing it for every limit cost Redis ~500
// instructions a value (bench/results.md).
func limitValues(rules []policy.Rule) int {
	n := 2 * len(rules)
	for i := range rules {
		if rules[i].Kind == policy.Balance {
			n++
		}
		if rules[i].Shadow {
			n++
		}
	}
	return n
}

// States decodes the values of a snapshot's limits (limitValues), one S per
// rule. Counts are held to [0, MaxCost], as the scripts saturate them, so
// that no snapshot of state an older release left can break the event
// contract.
func States[S state](v []int64, rules []policy.Rule) []S {
	out := make([]S, len(rules))
	k := 0
	for i := range out {
		r := &rules[i]
		lim, used, reset := r.Limit.Limit, v[k], v[k+1]
		k += 2
		switch r.Kind {
		case policy.TokenBucket:
			lim = r.Burst
		case policy.Balance:
			lim = v[k]
			k++
		}
		would := false
		if r.Shadow {
			would = v[k] == 1
			k++
		}
		lim, used = min(max(lim, 0), MaxCost), min(max(used, 0), MaxCost)
		out[i] = S{
			Rule: r, Limit: lim, Used: used, Remaining: max(0, lim-used),
			Reset: time.Duration(reset) * time.Millisecond, WouldDeny: would,
		}
	}
	return out
}

// SettleBatch gathers settles into one settle call (settle.lua), as
// ReserveBatch does reserves. Build it with Params.NewSettleBatch.
type SettleBatch struct {
	batch
}

// NewSettleBatch returns an empty batch.
func (p Params) NewSettleBatch() *SettleBatch {
	return &SettleBatch{p.newBatch()}
}

// Add adds the settle of op for requestID of (tenant, user): actual
// (SettleCorrect), the fallback's time and estimate (-1: none), and rules,
// of which it sends the token limits and concurrency slots, what a
// settlement touches. It checks the identifiers and the actual and adds
// nothing when they fail.
func (b *SettleBatch) Add(tenant, user, requestID string, op int, actual int64, rules []policy.Rule, fallbackAt, fallbackEstimate int64) error {
	if err := errors.Join(checkSubject(tenant, user), checkID("request_id", requestID, true), checkCost("actual", actual)); err != nil {
		return err
	}
	rules = settleRules(rules)
	keys, _ := subjectCallKeys(NewSubjectKeys(tenant, user), requestID, rules)
	conc, mem := keys[4:], member(keys)
	var h [settleHeadLen]byte
	h[0] = byte(op)
	putInt48(h[1:], actual)
	putInt48(h[7:], fallbackAt)
	putInt48(h[13:], fallbackEstimate)
	for i, k := range keys[:4] {
		binary.LittleEndian.PutUint16(h[19+2*i:], uint16(b.key(k)))
	}
	binary.LittleEndian.PutUint16(h[27:], uint16(len(rules)))
	binary.LittleEndian.PutUint16(h[29:], uint16(len(mem)))
	n := settleHeadLen + specLen*len(rules) + len(mem)
	for _, k := range conc {
		n += 2 + len(k)
		b.zset(k)
	}
	var w strings.Builder
	w.Grow(n)
	w.Write(h[:])
	writeSpecs(&w, rules, b.p.resTTL)
	w.WriteString(mem)
	writeKeys(&w, conc)
	b.add(w.String())
	b.rules = append(b.rules, rules)
	return nil
}

// settleRules keeps the rules a settlement touches: token limits and
// concurrency slots.
func settleRules(rules []policy.Rule) []policy.Rule {
	n := 0
	for i := range rules {
		if touchedBySettle(&rules[i]) {
			n++
		}
	}
	if n == len(rules) {
		return rules
	}
	out := make([]policy.Rule, 0, n)
	for i := range rules {
		if touchedBySettle(&rules[i]) {
			out = append(out, rules[i])
		}
	}
	return out
}

// KeepsRecord reports whether a reserve over rules keeps a reservation
// record: when a settlement would touch one of them. A reserve over request
// limits alone (no token limit, balance or concurrency slot) keeps none:
// nothing ever corrects, releases or frees what it charged, so the record
// would only tell a repeat of the request id apart, at the cost of a write
// per request (bench/results.md). Every such reserve is a new request.
func KeepsRecord(rules []policy.Rule) bool {
	for i := range rules {
		if touchedBySettle(&rules[i]) {
			return true
		}
	}
	return false
}

func touchedBySettle(r *policy.Rule) bool {
	return r.Unit == policy.Tokens || r.Kind == policy.Concurrency
}

// SettleReply is a decoded settle reply.
type SettleReply struct {
	Status, Delta, ReservedAtMs, NowMs, Version, TenantVersion int64
	// Prior is the record's state before the call, -1 for none.
	Prior    int64
	Estimate int64
	// Limits holds the values of its limits; States decodes them.
	Limits []int64
}

// DecodeSettles reads the reply of settle call c and passes f each
// settle's reply or error, in the order of c.Batch, as DecodeReserves does.
func DecodeSettles(cmd *redis.Cmd, c *Call, f func(i int, v SettleReply, err error)) {
	decodeBatch(cmd, c, func(i int, e any) {
		v, err := packedElement(nil, e, 8, c.Batch[i])
		if err != nil {
			f(i, SettleReply{}, err)
			return
		}
		f(i, SettleReply{
			Status: v[0], Delta: v[1], ReservedAtMs: v[2], NowMs: v[3], Version: v[4], TenantVersion: v[5],
			Prior: v[6], Estimate: v[7], Limits: v[8:],
		}, nil)
	}, func(i int, err error) { f(i, SettleReply{}, err) })
}

// ChargeCall is the charge call of amount (negative gives back) at time at
// (zero: now) to rules of (tenant, user), or, with scope set, of the
// shared scope's id. force applies it even when the epoch is missing (a
// rebuild from the ledger).
func (p Params) ChargeCall(tenant, user string, scope policy.Scope, id string, rules []policy.Rule, amount int64, at time.Time, force bool) Call {
	if err := checkCost("amount", abs(amount)); err != nil {
		return invalid(err)
	}
	var keys []string
	meta, what := "0", id
	if scope != "" {
		if err := errors.Join(checkID(string(scope), id, true), checkShared(rules)); err != nil {
			return invalid(err)
		}
		tag := sharedTag(scope, id)
		keys = []string{epochKey(tag), sharedBlob(tag)}
	} else {
		if err := checkSubject(tenant, user); err != nil {
			return invalid(err)
		}
		var m byte
		keys, m = subjectCallKeys(NewSubjectKeys(tenant, user), "-", rules)
		meta, what = strconv.Itoa(int(m)), tenant+"/"+user
	}
	atMs := int64(0)
	if !at.IsZero() {
		atMs = at.UnixMilli()
	}
	guard := p.guard
	if force {
		guard = "0"
	}
	return Call{
		Keys:  keys,
		Args:  []any{p.offset, amount, atMs, guard, meta, packSpecs(rules, p.resTTL)},
		Rules: rules,
		What:  "charge " + what,
	}
}

func abs(v int64) int64 {
	if v < 0 {
		return -v
	}
	return v
}

// DecodeCharge reads the reply of charge call c: the states of its rules.
func DecodeCharge[S state](cmd *redis.Cmd, c *Call) ([]S, error) {
	v, err := snapshotOf(cmd, c, 2)
	if err != nil {
		return nil, err
	}
	return States[S](v[2:], c.Rules), nil
}

// snapshotOf reads a snapshot reply with head values before the limits of
// call c.
func snapshotOf(cmd *redis.Cmd, c *Call, head int) ([]int64, error) {
	v, err := packedInts(cmd)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", c.What, err)
	}
	if len(v) == 1 && v[0] == -1 {
		return nil, ErrNoEpoch
	}
	if len(v) != head+limitValues(c.Rules) {
		return nil, fmt.Errorf("%s: reply of %d values for %d limits", c.What, len(v), len(c.Rules))
	}
	return v, nil
}

// packedInts reads a snapshot reply: 64-bit little-endian integers packed
// in one string, which the client reads in one piece where an array reply
// costs a read and an allocation per value.
func packedInts(cmd *redis.Cmd) ([]int64, error) {
	s, err := cmd.Text()
	if err != nil {
		return nil, err
	}
	return unpackInts(nil, s)
}

// unpackInts reads 64-bit little-endian integers packed in s, into dst's
// array when it has room.
func unpackInts(dst []int64, s string) ([]int64, error) {
	if len(s)%8 != 0 {
		return nil, fmt.Errorf("reply of %d bytes is not a list of 64-bit integers", len(s))
	}
	v := slices.Grow(dst[:0], len(s)/8)[:len(s)/8]
	for i := range v {
		v[i] = int64(binary.LittleEndian.Uint64([]byte(s[8*i : 8*i+8])))
	}
	return v, nil
}

// The ops of a lease call.
const (
	LeaseTake   = 1
	LeaseReturn = 2
)

// LeaseCall is the lease call of op for n units of shared limit r of
// scope's id (window: the lease's window id, for LeaseReturn).
func (p Params) LeaseCall(scope policy.Scope, id string, r *policy.Rule, op int, n, window int64) Call {
	if err := errors.Join(checkID(string(scope), id, true), checkCost("amount", n)); err != nil {
		return invalid(err)
	}
	tag := sharedTag(scope, id)
	return Call{
		Keys: []string{epochKey(tag), sharedBlob(tag)},
		Args: []any{p.offset, op, n, p.guard, window, packSpecs([]policy.Rule{*r}, p.resTTL)},
		What: "lease " + string(scope) + " " + id,
	}
}

// LeaseReply is a decoded lease reply.
type LeaseReply struct {
	Granted, WindowID, ExpiresMs, NowMs, Limit, Used, ResetMs int64
}

// DecodeLease reads the reply of lease call c.
func DecodeLease(cmd *redis.Cmd, c *Call) (LeaseReply, error) {
	v, err := cmd.Int64Slice()
	if err != nil {
		return LeaseReply{}, fmt.Errorf("%s: %w", c.What, err)
	}
	if len(v) == 1 && v[0] == -1 {
		return LeaseReply{}, ErrNoEpoch
	}
	if len(v) != 7 {
		return LeaseReply{}, fmt.Errorf("%s: reply of %d values", c.What, len(v))
	}
	return LeaseReply{Granted: v[0], WindowID: v[1], ExpiresMs: v[2], NowMs: v[3], Limit: v[4], Used: v[5], ResetMs: v[6]}, nil
}

// TopUpCall is the topup call of amount credits to balance r of (tenant,
// user), once per reference; for a tenant-wide balance user is ignored.
// force applies it even when the epoch is missing (a rebuild).
func (p Params) TopUpCall(tenant, user string, r *policy.Rule, amount int64, reference string, force bool) Call {
	if r.Kind != policy.Balance {
		return invalid(fmt.Errorf("%w: top up %s: not a balance", ErrInvalid, r.Name))
	}
	if r.Scope == policy.ScopeTenant {
		user = "-"
	}
	if err := errors.Join(checkSubject(tenant, user), checkID("reference", reference, true), checkCost("amount", amount)); err != nil {
		return invalid(err)
	}
	if amount == 0 {
		return invalid(fmt.Errorf("%w: amount: must be positive", ErrInvalid))
	}
	k := NewSubjectKeys(tenant, user)
	blob := k.Blob()
	if r.Scope == policy.ScopeTenant {
		blob = k.TenantBlob()
	}
	guard := p.guard
	if force {
		guard = "0"
	}
	return Call{
		Keys: []string{epochKey(k.Tag()), blob, k.TopUp(reference)},
		Args: []any{amount, topUpMarkerTTL, guard, packSpecs([]policy.Rule{*r}, p.resTTL)},
		What: "top up " + tenant + "/" + user,
	}
}

// DecodeTopUp reads the reply of topup call c: whether it applied, and the
// balance's credits and spending after it.
func DecodeTopUp(cmd *redis.Cmd, c *Call) (applied bool, credited, spent int64, err error) {
	v, err := cmd.Int64Slice()
	if err != nil {
		return false, 0, 0, fmt.Errorf("%s: %w", c.What, err)
	}
	if len(v) == 1 && v[0] == -1 {
		return false, 0, 0, ErrNoEpoch
	}
	if len(v) != 4 {
		return false, 0, 0, fmt.Errorf("%s: reply of %d values", c.What, len(v))
	}
	return v[0] == 1, v[1], v[2], nil
}

// VoidCall is the void call of the lost Reserve of requestID of (tenant,
// user) with fingerprint and nonce, allowed or denied without Redis.
func (p Params) VoidCall(tenant, user, requestID string, fingerprint, nonce int64, allowed bool) Call {
	if err := errors.Join(checkSubject(tenant, user), checkID("request_id", requestID, true)); err != nil {
		return invalid(err)
	}
	keys, _ := subjectCallKeys(NewSubjectKeys(tenant, user), requestID, nil)
	a := "0"
	if allowed {
		a = "1"
	}
	return Call{
		Keys: keys,
		Args: []any{p.offset, p.guard, a, fingerprint & mask48, nonce & mask48, p.resTTL, member(keys), tombTTL.Milliseconds()},
		What: "void reserve " + tenant + "/" + user,
	}
}

// DecodeVoid reads the reply of void call c: its status (void.lua).
func DecodeVoid(cmd *redis.Cmd, c *Call) (int64, error) {
	n, err := cmd.Int64()
	switch {
	case err != nil:
		return 0, fmt.Errorf("%s: %w", c.What, err)
	case n == -1:
		return 0, ErrNoEpoch
	}
	return n, nil
}

// AdmittedCall is the admitted call of requestID of (tenant, user).
func AdmittedCall(tenant, user, requestID string) Call {
	if err := errors.Join(checkSubject(tenant, user), checkID("request_id", requestID, true)); err != nil {
		return invalid(err)
	}
	return Call{
		Keys: []string{NewSubjectKeys(tenant, user).Reservation(requestID)},
		What: "admitted " + tenant + "/" + user,
	}
}

// DecodeAdmitted reads the reply of admitted call c.
func DecodeAdmitted(cmd *redis.Cmd, c *Call) (bool, error) {
	n, err := cmd.Int64()
	if err != nil {
		return false, fmt.Errorf("%s: %w", c.What, err)
	}
	return n == 1, nil
}

// RestoreCall is the restore call of the reservation record of requestID
// of (tenant, user): in state, of the request with fingerprint, its usage
// counting at reservedAt, estimate held while open, under rules (which a
// corrected record does not keep), until expires.
func (p Params) RestoreCall(tenant, user, requestID string, state byte, fingerprint int64, reservedAt time.Time, estimate int64, rules []policy.Rule, expires time.Time) Call {
	if err := errors.Join(checkSubject(tenant, user), checkID("request_id", requestID, true), checkCost("estimate", estimate)); err != nil {
		return invalid(err)
	}
	keys, _ := subjectCallKeys(NewSubjectKeys(tenant, user), requestID, rules)
	var head [recordHeadLen]byte
	putInt48(head[0:], reservedAt.UnixMilli())
	putInt48(head[6:], estimate)
	head[12] = state
	conc := keys[4:]
	if state == RecordCorrected { // as settle.lua leaves it: no tail
		rules, conc = nil, nil
	}
	rec := string(head[:]) + p.recordTail(fingerprint, 0, rules, conc)
	return Call{
		Keys: keys[1:2],
		Args: []any{rec, expires.UnixMilli()},
		What: "restore reservation " + tenant + "/" + user,
	}
}

// WindowsCall is the windows call that reads windowed rules of (tenant,
// user).
func (p Params) WindowsCall(tenant, user string, rules []policy.Rule) Call {
	if err := checkSubject(tenant, user); err != nil {
		return invalid(err)
	}
	for i := range rules {
		if !Windowed(&rules[i]) {
			return invalid(fmt.Errorf("%w: %s: a %s limit has no buckets to read", ErrInvalid, rules[i].Name, rules[i].Kind))
		}
	}
	k := NewSubjectKeys(tenant, user)
	return Call{
		Keys:  []string{k.Blob(), k.TenantBlob()},
		Args:  []any{p.offset},
		Rules: rules,
		What:  "windows " + tenant + "/" + user,
	}
}

// Windowed reports whether a windows call can read r: a rolling, fixed or
// calendar_month limit.
func Windowed(r *policy.Rule) bool {
	return r.Kind == policy.Rolling || r.Kind == policy.Fixed || r.Kind == policy.CalendarMonth
}

// bucket is the shape of repair.Bucket, which DecodeWindows fills (see
// state).
type bucket interface {
	~struct {
		N    int64
		Used int64
	}
}

// DecodeWindows reads the reply of windows call c and passes f the buckets
// of each of its rules, in order (all in one array), brought forward to the
// Redis time of the read, which it returns.
func DecodeWindows[B bucket](cmd *redis.Cmd, c *Call, f func(i int, buckets []B)) (time.Time, error) {
	v, err := cmd.Slice()
	if err != nil {
		return time.Time{}, fmt.Errorf("%s: %w", c.What, err)
	}
	if len(v) < 1 {
		return time.Time{}, fmt.Errorf("%s: empty reply", c.What)
	}
	nowMS, ok := v[0].(int64)
	if !ok {
		return time.Time{}, fmt.Errorf("%s: time is %T", c.What, v[0])
	}
	blob := func(i int) (string, error) {
		if i >= len(v) || v[i] == nil {
			return "", nil // Redis drops trailing nils of a Lua table
		}
		s, ok := v[i].(string)
		if !ok {
			return "", fmt.Errorf("%s: blob is %T", c.What, v[i])
		}
		return s, nil
	}
	sub, err := blob(1)
	if err != nil {
		return time.Time{}, err
	}
	ten, err := blob(2)
	if err != nil {
		return time.Time{}, err
	}
	// Blobs hold a handful of records: a linear search on the stack beats
	// a map per blob, which was most of a read's allocations.
	var subBuf, tenBuf [16]record
	subRecs, err := records(subBuf[:0], sub, nowMS)
	if err != nil {
		return time.Time{}, fmt.Errorf("%s: subject blob: %w", c.What, err)
	}
	tenRecs, err := records(tenBuf[:0], ten, nowMS)
	if err != nil {
		return time.Time{}, fmt.Errorf("%s: tenant blob: %w", c.What, err)
	}
	now := time.UnixMilli(nowMS)
	n := 0
	for i := range c.Rules {
		n += windowLen(&c.Rules[i])
	}
	all := make([]B, 0, n) // one array for every window's buckets
	for i := range c.Rules {
		r := &c.Rules[i]
		recs := subRecs
		if r.Scope == policy.ScopeTenant {
			recs = tenRecs
		}
		start := len(all)
		all = appendWindow(all, r, payloadOf(recs, r.ID()), now)
		f(i, all[start:len(all):len(all)])
	}
	return now, nil
}

// record is one live record of a blob.
type record struct {
	id      int64
	payload string
}

// records appends to dst the live records of a blob. Keep it in step with
// lib.lua's format: repair's TestWindows compares what it decodes with
// what the scripts report.
func records(dst []record, raw string, now int64) ([]record, error) {
	if raw == "" {
		return dst, nil
	}
	if len(raw) < 8 {
		return nil, fmt.Errorf("%d bytes", len(raw))
	}
	for p := 8; p < len(raw); {
		if p+14 > len(raw) {
			return nil, fmt.Errorf("record header past the end at %d", p)
		}
		id := int64(uint48(raw[p:]))
		exp := int48(raw[p+6:])
		n := int(binary.LittleEndian.Uint16([]byte(raw[p+12 : p+14])))
		if p+14+n > len(raw) {
			return nil, fmt.Errorf("record payload past the end at %d", p)
		}
		if exp > now {
			dst = append(dst, record{id, raw[p+14 : p+14+n]})
		}
		p += 14 + n
	}
	return dst, nil
}

// payloadOf returns the payload of record id of recs, the last one if the
// blob held it twice, or "" when it holds none.
func payloadOf(recs []record, id int64) string {
	for i := len(recs) - 1; i >= 0; i-- {
		if recs[i].id == id {
			return recs[i].payload
		}
	}
	return ""
}

// windowLen is how many buckets appendWindow returns for r.
func windowLen(r *policy.Rule) int {
	if r.Kind == policy.Rolling {
		return buckets(r)
	}
	return 1
}

// appendWindow appends to dst the buckets windowed rule r covers at now,
// given its record's payload (empty when it has none), brought forward to
// now as lib.lua's load does: buckets the window has left count nothing.
func appendWindow[B bucket](dst []B, r *policy.Rule, payload string, now time.Time) []B {
	cur := BucketOf(r, now)
	if r.Kind != policy.Rolling {
		b := B{N: cur}
		if len(payload) >= 12 && int48(payload) == cur {
			b = B{N: cur, Used: int48(payload[6:])}
		}
		return append(dst, b)
	}
	n := int64(buckets(r))
	var head int64 = math.MinInt64
	if len(payload) >= 18+6*int(n) {
		head = int48(payload)
	}
	for i := range n {
		bn, used := cur-n+1+i, int64(0)
		// buckets after the head were not written since the ring came round.
		if head != math.MinInt64 && cur-head < n && bn <= head {
			used = int48(payload[18+6*int(bn%n):])
		}
		dst = append(dst, B{N: bn, Used: used})
	}
	return dst
}

// BucketOf is repair.BucketOf: the number of the bucket of windowed rule r
// that holds what is charged at t.
func BucketOf(r *policy.Rule, t time.Time) int64 {
	ms := t.UnixMilli()
	switch r.Kind {
	case policy.Rolling:
		return floorDiv(ms, bucketMillis(r))
	case policy.Fixed:
		return floorDiv(ms, time.Duration(r.Window).Milliseconds())
	default:
		u := t.UTC()
		return int64(u.Year())*12 + int64(u.Month()) - 1
	}
}

// BucketStart is repair.BucketStart: when bucket n of windowed rule r
// begins.
func BucketStart(r *policy.Rule, n int64) time.Time {
	switch r.Kind {
	case policy.Rolling:
		return time.UnixMilli(n * bucketMillis(r))
	case policy.Fixed:
		return time.UnixMilli(n * time.Duration(r.Window).Milliseconds())
	default:
		return time.Date(int(floorDiv(n, 12)), time.Month(n-floorDiv(n, 12)*12+1), 1, 0, 0, 0, 0, time.UTC)
	}
}

// bucketMillis is a rolling window's bucket length, as a spec sends it.
func bucketMillis(r *policy.Rule) int64 {
	return time.Duration(r.Window).Milliseconds() / int64(buckets(r))
}

func floorDiv(a, b int64) int64 {
	q := a / b
	if a%b != 0 && (a < 0) != (b < 0) {
		q--
	}
	return q
}

// buckets returns the bucket count of a rolling window.
func buckets(r *policy.Rule) int {
	if r.Buckets > 0 {
		return r.Buckets
	}
	return policy.DefaultBuckets
}

// subjectCallKeys returns the KEYS of a subject call: the epoch, the
// reservation record ("" for an empty requestID: a call that names none),
// the subject and tenant blobs, then one sorted set per concurrency limit;
// and the meta byte saying whether the tenant blob is involved.
func subjectCallKeys(k SubjectKeys, requestID string, rules []policy.Rule) ([]string, byte) {
	keys := make([]string, 0, 4+len(rules))
	// The blobs and the record are cut from one string: one allocation
	// of every reserve, not three.
	var buf [256]byte
	b := k.appendBlob(buf[:0])
	blob := len(b)
	b = k.appendTenantBlob(b)
	tenant := len(b)
	if requestID != "" {
		b = k.appendReservation(b, requestID)
	}
	all := string(b)
	keys = append(keys, epochKey(k.Tag()), all[tenant:], all[:blob], all[blob:tenant])
	meta := byte(1)
	for i := range rules {
		if rules[i].Scope == policy.ScopeTenant {
			meta = 2
		}
		if rules[i].Kind == policy.Concurrency {
			keys = append(keys, k.Concurrency(&rules[i]))
		}
	}
	return keys, meta
}

// member is the concurrency member of a subject call's request: the
// reservation record's key after its tag, unique per (user, request id), so
// two users of a tenant never share a slot of a tenant-wide limit.
func member(keys []string) string {
	rec := keys[1]
	return rec[strings.Index(rec, "}r:")+3:]
}

// recordTail is a reservation record after its state byte: the request's
// fingerprint and the call's nonce, the count and the packed specs of
// rules, then conc, the sorted set key of each concurrency limit among
// them (as subjectCallKeys built them for rules).
func (p Params) recordTail(fingerprint, nonce int64, rules []policy.Rule, conc []string) string {
	var b strings.Builder
	b.Grow(tailLen(rules, conc))
	p.writeTail(&b, fingerprint, nonce, rules, conc)
	return b.String()
}

func tailLen(rules []policy.Rule, conc []string) int {
	n := tailHeadLen + specLen*len(rules)
	for _, k := range conc {
		n += 2 + len(k)
	}
	return n
}

func (p Params) writeTail(b *strings.Builder, fingerprint, nonce int64, rules []policy.Rule, conc []string) {
	var n [tailHeadLen]byte
	putInt48(n[0:], fingerprint&mask48)
	putInt48(n[6:], nonce&mask48)
	binary.LittleEndian.PutUint16(n[12:], uint16(len(rules)))
	b.Write(n[:])
	writeSpecs(b, rules, p.resTTL)
	writeKeys(b, conc)
}

// writeKeys writes each of keys to b after its length (I2).
func writeKeys(b *strings.Builder, keys []string) {
	var n [2]byte
	for _, k := range keys {
		b.Write(binary.LittleEndian.AppendUint16(n[:0], uint16(len(k))))
		b.WriteString(k)
	}
}

// packSpecs packs every rule into one spec string; slotTTL is a
// concurrency slot's ttl.
func packSpecs(rules []policy.Rule, slotTTL int64) string {
	var b strings.Builder // one allocation: String does not copy
	b.Grow(specLen * len(rules))
	writeSpecs(&b, rules, slotTTL)
	return b.String()
}

// writeSpecs writes the packed spec of every rule to b.
func writeSpecs(b *strings.Builder, rules []policy.Rule, slotTTL int64) {
	var w [specLen]byte
	for i := range rules {
		r := &rules[i]
		var flags byte
		if r.Unit == policy.Tokens {
			flags |= flagTokens
		}
		if r.Shadow {
			flags |= flagShadow
		}
		if r.Scope == policy.ScopeTenant {
			flags |= flagTenant
		}
		limit, a, c := float64(r.Limit.Limit), 0.0, 0.0
		switch r.Kind {
		case policy.Rolling:
			n := int64(buckets(r))
			a, c = float64(time.Duration(r.Window).Milliseconds()/n), float64(n)
		case policy.Fixed, policy.SlidingLog:
			a = float64(time.Duration(r.Window).Milliseconds())
		case policy.TokenBucket:
			limit = float64(r.Burst)
			a = r.Rate / float64(time.Duration(r.Per).Milliseconds())
			c = float64(time.Duration(r.Per).Milliseconds())
		case policy.Concurrency:
			a = float64(slotTTL)
		}
		id := uint64(r.ID())
		for k := range 6 {
			w[k] = byte(id >> (8 * k))
		}
		w[6], w[7] = kindCode[r.Kind], flags
		binary.LittleEndian.PutUint64(w[8:], math.Float64bits(limit))
		binary.LittleEndian.PutUint64(w[16:], math.Float64bits(a))
		binary.LittleEndian.PutUint64(w[24:], math.Float64bits(c))
		b.Write(w[:])
	}
}

// putInt48 writes v as a little-endian 48-bit integer (i6).
func putInt48(b []byte, v int64) {
	for k := range 6 {
		b[k] = byte(v >> (8 * k))
	}
}

func uint48(b string) uint64 {
	var v uint64
	for i := 5; i >= 0; i-- {
		v = v<<8 | uint64(b[i])
	}
	return v
}

// int48 reads a little-endian signed 48-bit integer (i6).
func int48(b string) int64 {
	return int64(uint48(b)<<16) >> 16
}
