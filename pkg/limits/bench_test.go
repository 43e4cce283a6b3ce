package limits

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits/internal/wire"
	"quotaflow/pkg/limits/policy"
)

// benchRules is the default plan of a subject: three rolling token windows,
// a request token bucket and a tenant-wide calendar month.
func benchRules() []policy.Rule {
	return []policy.Rule{
		{Limit: policy.Limit{Name: "month", Kind: policy.CalendarMonth, Unit: policy.Tokens, Limit: 1 << 40}, Scope: policy.ScopeTenant},
		{Limit: policy.Limit{Name: "5h", Kind: policy.Rolling, Unit: policy.Tokens, Limit: 1 << 30, Window: policy.Duration(5 * time.Hour)}, Scope: policy.ScopeUser},
		{Limit: policy.Limit{Name: "7d", Kind: policy.Rolling, Unit: policy.Tokens, Limit: 1 << 30, Window: policy.Duration(168 * time.Hour)}, Scope: policy.ScopeUser},
		{Limit: policy.Limit{Name: "30d", Kind: policy.Rolling, Unit: policy.Tokens, Limit: 1 << 30, Window: policy.Duration(720 * time.Hour)}, Scope: policy.ScopeUser},
		{Limit: policy.Limit{Name: "rps", Kind: policy.TokenBucket, Unit: policy.Requests, Rate: 1e6, Per: policy.Duration(time.Second), Burst: 1e6}, Scope: policy.ScopeUser},
	}
}

// commandUsec reads the total usec and calls of one command from INFO commandstats.
func commandUsec(b *testing.B, c *redis.Client, cmd string) (usec, calls float64) {
	info, err := c.Info(context.Background(), "commandstats").Result()
	if err != nil {
		b.Fatal(err)
	}
	for _, line := range strings.Split(info, "\n") {
		if !strings.HasPrefix(line, "cmdstat_"+cmd+":") {
			continue
		}
		for _, kv := range strings.Split(strings.TrimSpace(line[len("cmdstat_"+cmd+":"):]), ",") {
			k, v, _ := strings.Cut(kv, "=")
			f, _ := strconv.ParseFloat(v, 64)
			switch k {
			case "usec":
				usec = f
			case "calls":
				calls = f
			}
		}
	}
	return usec, calls
}

// BenchmarkReserve reserves over 5 limits on a private Redis, so INFO
// commandstats holds only this benchmark's calls, and beside it the plain
// baseline of one INCR per operation. Three user mixes: 100k distinct users
// (at -benchtime 20000x the first repetition meets only new subjects, the
// next ones the same 20000 again), every reserve a new subject (first
// touch: new keys, every window built), and 1000 users whose blobs exist
// (steady: active users).
func BenchmarkReserve(b *testing.B) {
	srv := redistest.Start(b)
	c := srv.Client()
	ctx := context.Background()
	// The guard reads the epoch key of acme's slot, all this Redis needs.
	if err := c.Set(ctx, wire.SlotEpochKey(wire.TenantSlot("acme")), "bench", 0).Err(); err != nil {
		b.Fatal(err)
	}
	const users = 100_000
	ids := make([]string, users)
	for i := range ids {
		ids[i] = "user-" + strconv.Itoa(i)
	}
	rules := benchRules()
	l := New(c, Options{})
	hook := &redistest.RoundTrips{}
	c.AddHook(hook)
	reserve := func(b *testing.B, user string, id string) {
		d, err := l.Reserve(ctx, Request{Tenant: "acme", User: user, RequestID: id, Cost: 100, Rules: rules})
		if err != nil || !d.Allowed {
			b.Fatalf("Reserve = %+v, %v", d, err)
		}
	}
	run := func(name string, user func(i int) string) {
		b.Run(name, func(b *testing.B) {
			c.ConfigResetStat(ctx)
			sent := hook.Count()
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				i++
				reserve(b, user(i), name+"-"+strconv.Itoa(i))
			}
			usec, calls := commandUsec(b, c, "fcall")
			b.ReportMetric(usec/calls, "redis-us/op")
			b.ReportMetric(float64(hook.Count()-sent-1)/float64(b.N), "roundtrips/op") // -1: the INFO
		})
	}

	run("limits=5", func(i int) string { return ids[i%users] })
	runs := 0 // -count repeats a sub-benchmark: each repetition needs subjects of its own
	run("limits=5,subjects=new", func(i int) string {
		if i == 1 {
			runs++
		}
		return "new-" + strconv.Itoa(runs) + "-" + strconv.Itoa(i)
	})
	for i := range 1000 { // the steady mix's blobs exist before it starts
		reserve(b, "steady-"+strconv.Itoa(i), "warm-"+strconv.Itoa(i))
	}
	run("limits=5,subjects=1000", func(i int) string { return "steady-" + strconv.Itoa(i%1000) })

	b.Run("baseline=incr", func(b *testing.B) {
		c.ConfigResetStat(ctx)
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			i++
			if err := c.Incr(ctx, ids[i%users]).Err(); err != nil {
				b.Fatal(err)
			}
		}
		usec, calls := commandUsec(b, c, "incr")
		b.ReportMetric(usec/calls, "redis-us/op")
	})
}

// BenchmarkSubjectMemory fills every bucket of every window of 1000
// subjects and reports Redis bytes per subject (MEMORY USAGE of its blob)
// and per reservation record, open and once corrected. The fill runs once, whatever -benchtime says;
// the timed loop only reads one subject's memory usage.
func BenchmarkSubjectMemory(b *testing.B) {
	srv := redistest.Start(b)
	c := srv.Client()
	ctx := context.Background()
	rules := benchRules()[1:] // the tenant-wide month is shared, not per subject
	const subjects = 1000
	var subjectBytes, recordBytes, correctedBytes int64
	for s := range subjects {
		user := "user-" + strconv.Itoa(s)
		k := wire.NewSubjectKeys("acme", user)
		// One charge in every bucket of the longest window fills all windows.
		for h := 0; h < 720; h += 30 {
			l := New(c, Options{NoEpochGuard: true, ClockOffset: -time.Duration(h) * time.Hour})
			if _, err := l.Reserve(ctx, Request{Tenant: "acme", User: user, RequestID: fmt.Sprint(h), Cost: 1, Rules: rules}); err != nil {
				b.Fatal(err)
			}
		}
		subjectBytes += c.MemoryUsage(ctx, k.Blob()).Val()
		recordBytes += c.MemoryUsage(ctx, k.Reservation("0")).Val()
		if _, err := New(c, Options{NoEpochGuard: true}).Correct(ctx, Settle{Tenant: "acme", User: user, RequestID: "0", Actual: 1, Rules: rules}); err != nil {
			b.Fatal(err)
		}
		correctedBytes += c.MemoryUsage(ctx, k.Reservation("0")).Val()
	}
	blob := wire.NewSubjectKeys("acme", "user-0").Blob()
	for b.Loop() {
		c.MemoryUsage(ctx, blob)
	}
	b.ReportMetric(float64(subjectBytes)/subjects, "bytes/subject")
	b.ReportMetric(float64(recordBytes)/subjects, "bytes/reservation")
	b.ReportMetric(float64(correctedBytes)/subjects, "bytes/corrected")
}

// BenchmarkPeekPage reads the limits of a page of 500 subjects whose blobs
// exist, as the accounter's GET /v1/usage/near does: by PeekBatch (one
// pipelined round trip of wire.MaxBatch subjects a script call), a page of
// 50 (its default) so, and, its baseline, by 500 Peek calls one after
// another. An op is one page.
func BenchmarkPeekPage(b *testing.B) {
	srv := redistest.Start(b)
	c := srv.Client()
	ctx := context.Background()
	if err := c.Set(ctx, wire.SlotEpochKey(wire.TenantSlot("acme")), "bench", 0).Err(); err != nil {
		b.Fatal(err)
	}
	rules := benchRules()
	l := New(c, Options{})
	const page = 500
	reqs := make([]Request, page)
	for i := range reqs {
		reqs[i] = Request{Tenant: "acme", User: "user-" + strconv.Itoa(i), Rules: rules}
		r := reqs[i]
		r.RequestID, r.Cost = "warm-"+strconv.Itoa(i), 100
		if d, err := l.Reserve(ctx, r); err != nil || !d.Allowed {
			b.Fatalf("Reserve = %+v, %v", d, err)
		}
	}
	hook := &redistest.RoundTrips{}
	c.AddHook(hook)
	run := func(name string, read func(b *testing.B)) {
		b.Run(name, func(b *testing.B) {
			c.ConfigResetStat(ctx)
			sent := hook.Count()
			b.ReportAllocs()
			for b.Loop() {
				read(b)
			}
			usec, _ := commandUsec(b, c, "fcall")
			b.ReportMetric(usec/float64(b.N), "redis-us/op")
			b.ReportMetric(float64(hook.Count()-sent-2)/float64(b.N), "roundtrips/op") // -2: CONFIG RESETSTAT, INFO
		})
	}
	run("peekbatch=500", func(b *testing.B) {
		for _, r := range l.PeekBatch(ctx, reqs) {
			if r.Err != nil || r.Decision.States[1].Used != 100 {
				b.Fatalf("PeekBatch = %+v, %v", r.Decision, r.Err)
			}
		}
	})
	run("peekbatch=50", func(b *testing.B) { // the accounter's default page
		for _, r := range l.PeekBatch(ctx, reqs[:50]) {
			if r.Err != nil || r.Decision.States[1].Used != 100 {
				b.Fatalf("PeekBatch = %+v, %v", r.Decision, r.Err)
			}
		}
	})
	run("peek=500", func(b *testing.B) {
		for _, r := range reqs {
			if d, err := l.Peek(ctx, r); err != nil || d.States[1].Used != 100 {
				b.Fatalf("Peek = %+v, %v", d, err)
			}
		}
	})
}
