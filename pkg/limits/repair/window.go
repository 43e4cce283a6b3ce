package repair

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/pkg/limits/internal/script"
	"quotaflow/pkg/limits/internal/wire"
	"quotaflow/pkg/limits/policy"
)

// Window is what one token window of a subject holds now, bucket by bucket:
// the n buckets of a rolling window, oldest first, or the one current
// window of a fixed or calendar_month limit.
type Window struct {
	Rule    *policy.Rule // the rule, from the slice the caller passed
	Buckets []Bucket
}

// Bucket is one counter of a Window.
type Bucket struct {
	N    int64 // the bucket's number: BucketOf of any time inside it
	Used int64
}

// Used is the window's total, what limits.Limiter.Peek reports as used.
func (w *Window) Used() int64 {
	var t int64
	for _, b := range w.Buckets {
		t += b.Used
	}
	return t
}

// Windowed reports whether Windows can read r: a rolling, fixed or
// calendar_month limit.
func Windowed(r *policy.Rule) bool { return wire.Windowed(r) }

// BucketOf returns the number of the bucket of windowed rule r that holds
// what is charged at t: the bucket (rolling) or window (fixed) counted from
// the Unix epoch, the month (year*12 + month - 1, UTC) of calendar_month.
// Numbers only grow with time, so a bucket keeps its number while the
// window slides over it.
func BucketOf(r *policy.Rule, t time.Time) int64 { return wire.BucketOf(r, t) }

// BucketStart returns when bucket n of windowed rule r begins: a Charge at
// that time lands in that bucket.
func BucketStart(r *policy.Rule, n int64) time.Time { return wire.BucketStart(r, n) }

// Windows reads the windowed limits rules of (tenant, user) bucket by
// bucket, with the Redis time of the read, without changing anything. The
// accounter's reconciliation compares them with its ledger. It returns
// limits.ErrInvalid for a rule that is not windowed.
func (t *Tools) Windows(ctx context.Context, tenant, user string, rules []policy.Rule) (time.Time, []Window, error) {
	c := t.p.WindowsCall(tenant, user, rules)
	if c.Err != nil {
		return time.Time{}, nil, c.Err
	}
	return decodeWindows(t.run.Run(ctx, script.Windows, &c), &c)
}

// WindowsRequest names the subject and the rules of one read of
// WindowsMany.
type WindowsRequest struct {
	Tenant, User string
	Rules        []policy.Rule
}

// WindowsResult is what Windows would have returned for one
// WindowsRequest.
type WindowsResult struct {
	Now     time.Time
	Windows []Window
	Err     error
}

// WindowsMany reads every request as Windows does, in one pipelined round
// trip (one per node of a Redis Cluster) like ChargeMany, and returns the
// results in the order of reqs. Each read is its own script run, atomic
// for its subject with its own Redis time; reads of different subjects
// are not one snapshot. An invalid request or a failed read fails only its
// own result.
func (t *Tools) WindowsMany(ctx context.Context, reqs []WindowsRequest) []WindowsResult {
	calls := make([]wire.Call, len(reqs))
	for i := range reqs {
		calls[i] = t.p.WindowsCall(reqs[i].Tenant, reqs[i].User, reqs[i].Rules)
	}
	cmds := t.run.RunAll(ctx, script.Windows, calls)
	out := make([]WindowsResult, len(reqs))
	for i := range calls {
		if calls[i].Err != nil {
			out[i].Err = calls[i].Err
			continue
		}
		out[i].Now, out[i].Windows, out[i].Err = decodeWindows(cmds[i], &calls[i])
	}
	return out
}

// decodeWindows reads the reply of windows call c.
func decodeWindows(cmd *redis.Cmd, c *wire.Call) (time.Time, []Window, error) {
	out := make([]Window, len(c.Rules))
	now, err := wire.DecodeWindows(cmd, c, func(i int, b []Bucket) {
		out[i] = Window{Rule: &c.Rules[i], Buckets: b}
	})
	if err != nil {
		return time.Time{}, nil, err
	}
	return now, out, nil
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
		it := c.Scan(ctx, 0, wire.SubjectBlobPattern, 1000).Iterator()
		for it.Next(ctx) {
			tenant, user, ok := wire.SubjectOf(it.Val())
			if !ok {
				continue
			}
			mu.Lock()
			f(tenant, user)
			mu.Unlock()
		}
		return it.Err()
	}
	if err := script.EachNode(ctx, c, scan); err != nil {
		return fmt.Errorf("scan subjects: %w", err)
	}
	return nil
}
