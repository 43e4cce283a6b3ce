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
	"time"

	"github.com/redis/go-redis/v9"
)

//go:embed lua/windows.lua
var luaWindows string

// windowsEntry runs as a script only: windows.lua has no lib.lua, whose
// rebuild on every call is what the function library spares.
var windowsEntry = &entry{script: redis.NewScript(luaWindows)}

// Window is what one token window of a subject holds now, bucket by bucket:
// the n buckets of a rolling window, oldest first, or the one current
// window of a fixed or calendar_month limit.
type Window struct {
	Rule    *Rule // the rule, from the slice the caller passed
	Buckets []Bucket
}

// Bucket is one counter of a Window.
type Bucket struct {
	N    int64 // the bucket's number: BucketOf of any time inside it
	Used int64
}

// Used is the window's total, what Peek reports as used.
func (w *Window) Used() int64 {
	var t int64
	for _, b := range w.Buckets {
		t += b.Used
	}
	return t
}

// Windowed reports whether Windows can read r: a rolling, fixed or
// calendar_month limit.
func Windowed(r *Rule) bool {
	return r.Kind == Rolling || r.Kind == Fixed || r.Kind == CalendarMonth
}

// BucketOf returns the number of the bucket of windowed rule r that holds
// what is charged at t: the bucket (rolling) or window (fixed) counted from
// the Unix epoch, the month (year*12 + month - 1, UTC) of calendar_month.
// Numbers only grow with time, so a bucket keeps its number while the
// window slides over it.
func BucketOf(r *Rule, t time.Time) int64 {
	ms := t.UnixMilli()
	switch r.Kind {
	case Rolling:
		return floorDiv(ms, bucketMillis(r))
	case Fixed:
		return floorDiv(ms, time.Duration(r.Window).Milliseconds())
	default:
		u := t.UTC()
		return int64(u.Year())*12 + int64(u.Month()) - 1
	}
}

// BucketStart returns when bucket n of windowed rule r begins: a Charge at
// that time lands in that bucket.
func BucketStart(r *Rule, n int64) time.Time {
	switch r.Kind {
	case Rolling:
		return time.UnixMilli(n * bucketMillis(r))
	case Fixed:
		return time.UnixMilli(n * time.Duration(r.Window).Milliseconds())
	default:
		return time.Date(int(floorDiv(n, 12)), time.Month(n-floorDiv(n, 12)*12+1), 1, 0, 0, 0, 0, time.UTC)
	}
}

// bucketMillis is a rolling window's bucket length, as packSpecs sends it.
func bucketMillis(r *Rule) int64 {
	return time.Duration(r.Window).Milliseconds() / int64(buckets(r))
}

func floorDiv(a, b int64) int64 {
	q := a / b
	if a%b != 0 && (a < 0) != (b < 0) {
		q--
	}
	return q
}

// Windows reads the windowed limits rules of (tenant, user) bucket by
// bucket, with the Redis time of the read, without changing anything. The
// accounter's reconciliation compares them with its ledger. It returns
// ErrInvalid for a rule that is not windowed.
func (l *Limiter) Windows(ctx context.Context, tenant, user string, rules []Rule) (time.Time, []Window, error) {
	c := l.windowsCall(tenant, user, rules)
	if c.err != nil {
		return time.Time{}, nil, c.err
	}
	return parseWindows(l.run(ctx, windowsEntry, c.keys, c.args...), &c)
}

// WindowsRequest names the subject and the rules of one read of
// WindowsMany.
type WindowsRequest struct {
	Tenant, User string
	Rules        []Rule
}

// WindowsResult is what Windows would have returned for one
// WindowsRequest.
type WindowsResult struct {
	Now     time.Time
	Windows []Window
	Err     error
}

// WindowsMany reads every request as Windows does, in one pipelined round
// trip (one per node of a Redis Cluster) like SettleMany, and returns the
// results in the order of reqs. Each read is its own script run, atomic
// for its subject with its own Redis time; reads of different subjects
// are not one snapshot. An invalid request or a failed read fails only its
// own result.
func (l *Limiter) WindowsMany(ctx context.Context, reqs []WindowsRequest) []WindowsResult {
	calls := make([]call, len(reqs))
	for i := range reqs {
		calls[i] = l.windowsCall(reqs[i].Tenant, reqs[i].User, reqs[i].Rules)
	}
	cmds := l.runAll(ctx, windowsEntry, calls)
	out := make([]WindowsResult, len(reqs))
	for i := range calls {
		if calls[i].err != nil {
			out[i].Err = calls[i].err
			continue
		}
		out[i].Now, out[i].Windows, out[i].Err = parseWindows(cmds[i], &calls[i])
	}
	return out
}

// windowsCall validates a read of rules of (tenant, user) and builds its
// windows.lua call.
func (l *Limiter) windowsCall(tenant, user string, rules []Rule) call {
	if err := errors.Join(checkID("tenant", tenant, true), checkID("user", user, true)); err != nil {
		return call{err: err}
	}
	for i := range rules {
		if !Windowed(&rules[i]) {
			return call{err: fmt.Errorf("%w: %s: a %s limit has no buckets to read", ErrInvalid, rules[i].Name, rules[i].Kind)}
		}
	}
	k := newSubjectKeys(tenant, user)
	return call{
		keys:  []string{k.blob(), k.tenantBlob()},
		args:  []any{l.offset},
		rules: rules,
		what:  "windows " + tenant + "/" + user,
	}
}

// parseWindows decodes the reply of windows.lua call c.
func parseWindows(cmd *redis.Cmd, c *call) (time.Time, []Window, error) {
	v, err := cmd.Slice()
	if err != nil {
		return time.Time{}, nil, fmt.Errorf("%s: %w", c.what, err)
	}
	if len(v) < 1 {
		return time.Time{}, nil, fmt.Errorf("%s: empty reply", c.what)
	}
	nowMS, ok := v[0].(int64)
	if !ok {
		return time.Time{}, nil, fmt.Errorf("%s: time is %T", c.what, v[0])
	}
	blob := func(i int) (string, error) {
		if i >= len(v) || v[i] == nil {
			return "", nil // Redis drops trailing nils of a Lua table
		}
		s, ok := v[i].(string)
		if !ok {
			return "", fmt.Errorf("%s: blob is %T", c.what, v[i])
		}
		return s, nil
	}
	sub, err := blob(1)
	if err != nil {
		return time.Time{}, nil, err
	}
	ten, err := blob(2)
	if err != nil {
		return time.Time{}, nil, err
	}
	// Blobs hold a handful of records: a linear search on the stack beats
	// a map per blob, which was most of a read's allocations.
	var subBuf, tenBuf [16]record
	subRecs, err := records(subBuf[:0], sub, nowMS)
	if err != nil {
		return time.Time{}, nil, fmt.Errorf("%s: subject blob: %w", c.what, err)
	}
	tenRecs, err := records(tenBuf[:0], ten, nowMS)
	if err != nil {
		return time.Time{}, nil, fmt.Errorf("%s: tenant blob: %w", c.what, err)
	}
	now := time.UnixMilli(nowMS)
	out := make([]Window, len(c.rules))
	n := 0
	for i := range c.rules {
		n += windowLen(&c.rules[i])
	}
	all := make([]Bucket, 0, n) // one array for every window's buckets
	for i := range c.rules {
		r := &c.rules[i]
		recs := subRecs
		if r.Scope == ScopeTenant {
			recs = tenRecs
		}
		start := len(all)
		all = decodeWindow(all, r, payloadOf(recs, ruleID(r)), now)
		out[i] = Window{Rule: r, Buckets: all[start:len(all):len(all)]}
	}
	return now, out, nil
}

// record is one live record of a blob.
type record struct {
	id      int64
	payload string
}

// records appends to dst the live records of a blob (lua/lib.lua: a
// version, then records of id, expiry, payload length and payload). Keep
// it in step with lib.lua's format: TestWindows compares what it decodes
// with what the scripts report.
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

// windowLen is how many buckets decodeWindow returns for r.
func windowLen(r *Rule) int {
	if r.Kind == Rolling {
		return buckets(r)
	}
	return 1
}

// decodeWindow appends to dst the buckets windowed rule r covers at now,
// given its record's payload (empty when it has none), brought forward to
// now as lib.lua's load does: buckets the window has left count nothing.
func decodeWindow(dst []Bucket, r *Rule, payload string, now time.Time) []Bucket {
	cur := BucketOf(r, now)
	if r.Kind != Rolling {
		b := Bucket{N: cur}
		if len(payload) >= 12 && int48(payload) == cur {
			b.Used = int48(payload[6:])
		}
		return append(dst, b)
	}
	n := int64(buckets(r))
	var head int64 = math.MinInt64
	if len(payload) >= 18+6*int(n) {
		head = int48(payload)
	}
	for i := range n {
		b := Bucket{N: cur - n + 1 + i}
		// Buckets after the head were not written since the ring came round.
		if head != math.MinInt64 && cur-head < n && b.N <= head {
			b.Used = int48(payload[18+6*int(b.N%n):])
		}
		dst = append(dst, b)
	}
	return dst
}

func uint48(b string) uint64 {
	var v uint64
	for i := 5; i >= 0; i-- {
		v = v<<8 | uint64(b[i])
	}
	return v
}

// int48 reads a little-endian signed 48-bit integer (struct's i6).
func int48(b string) int64 {
	return int64(uint48(b)<<16) >> 16
}

// ScanSubjects calls f for every subject blob (tenant, user) and tenant
// blob (tenant, "") in Redis, reading the key space with SCAN cursors (on
// every master of a Redis Cluster), never KEYS, so Redis keeps serving
// between the pages. A key written or deleted during the scan may be
// reported or not; none present throughout is missed. f may be called
// from several goroutines on a cluster, never at once.
func ScanSubjects(ctx context.Context, c redis.UniversalClient, f func(tenant, user string)) error {
	var mu sync.Mutex
	scan := func(ctx context.Context, c redis.Cmdable) error {
		// Escaped text holds no '}', so the tag ends at the first one; "u:"
		// starts a subject blob and "t" is the tenant blob.
		it := c.Scan(ctx, 0, "q{*}[ut]*", 1000).Iterator()
		for it.Next(ctx) {
			key := it.Val()
			end := strings.IndexByte(key, '}')
			if end < 0 {
				continue
			}
			tenant, rest := key[2:end], key[end+1:]
			if strings.HasPrefix(tenant, "%g") || strings.HasPrefix(tenant, "%i") {
				continue // a shared scope's tag, which no escaped tenant spells
			}
			var user string
			switch {
			case rest == "t":
			case strings.HasPrefix(rest, "u:") && len(rest) > 2:
				user = unesc(rest[2:])
			default:
				continue
			}
			mu.Lock()
			f(unesc(tenant), user)
			mu.Unlock()
		}
		return it.Err()
	}
	if err := eachNode(ctx, c, scan); err != nil {
		return fmt.Errorf("scan subjects: %w", err)
	}
	return nil
}

// unesc reverses esc.
func unesc(s string) string {
	if !strings.Contains(s, "%") {
		return s
	}
	r := strings.NewReplacer("%25", "%", "%7B", "{", "%7D", "}", "%3A", ":")
	return r.Replace(s)
}
