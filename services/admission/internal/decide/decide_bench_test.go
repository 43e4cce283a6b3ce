package decide

import (
	"context"
	"runtime"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/redis/go-redis/v9"

	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
)

// A plan of 5 limits, large enough that nothing denies during a benchmark.
const benchPolicy = `
default_plan: pro
plans:
  pro:
    quotas:
      - {name: 5m, kind: rolling, window: 5m, limit: 1000000000}
      - {name: 1h, kind: rolling, window: 1h, limit: 1000000000}
      - {name: hour, kind: fixed, window: 1h, limit: 1000000000}
    rates:
      - {name: rps, kind: token_bucket, rate: 1000000, per: 1s, burst: 1000000}
      - {name: inflight, kind: concurrency, limit: 1000000}
endpoints:
  /gen:
    global: [{name: daily, kind: fixed, window: 24h, limit: 1000000000000}]
`

const benchUsers = 100_000

// BenchmarkAdmit measures Admit against a private redis-server over 100k
// users with a plan of 5 limits: user-only (endpoint /any: exactly one
// round trip), with a leased global limit (/gen: one round trip plus a
// lease every 100 admits), serial and parallel, and with Redis down (the
// breaker open: local decisions). It reports round trips and local
// decisions per admit (local/op should be 0 but for the redis-down case).
func BenchmarkAdmit(b *testing.B) {
	users := make([]string, benchUsers)
	for i := range users {
		users[i] = "u" + strconv.Itoa(i)
	}
	pol := parsePolicy(b, benchPolicy, "")
	s := redistest.Start(b)
	rt := &redistest.RoundTrips{}
	c := redis.NewClient(&redis.Options{Addr: s.Addr, ContextTimeoutEnabled: true, MaxRetries: -1, PoolSize: 64})
	b.Cleanup(func() { c.Close() })
	c.AddHook(rt)
	lo := limits.Options{NoEpochGuard: true, ReservationTTL: time.Minute}

	var seq atomic.Int64
	input := func(endpoint string) Input {
		i := seq.Add(1)
		return Input{RequestID: strconv.FormatInt(i, 36), Tenant: "bench", User: users[i%benchUsers], Endpoint: endpoint, Cost: 10}
	}
	run := func(b *testing.B, d *Decider, endpoint string, parallel bool) {
		ctx := context.Background()
		var local atomic.Int64
		admitOne := func() {
			r, err := d.Admit(ctx, input(endpoint))
			if err != nil {
				b.Fatal(err)
			}
			if r.Local {
				local.Add(1)
			}
		}
		admitOne() // loads the scripts, takes the first lease
		quiesce(b, d)
		rt.Reset()
		b.ReportAllocs()
		b.ResetTimer()
		if parallel {
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					admitOne()
				}
			})
		} else {
			for b.Loop() {
				admitOne()
			}
		}
		b.StopTimer()
		b.ReportMetric(float64(rt.Count())/float64(b.N), "roundtrips/op")
		b.ReportMetric(float64(local.Load())/float64(b.N), "local/op")
	}

	for _, bc := range []struct{ name, endpoint string }{{"user-only", "/any"}, {"global-leased", "/gen"}} {
		for _, parallel := range []bool{false, true} {
			name := bc.name
			if parallel {
				name += "/parallel"
			}
			b.Run(name, func(b *testing.B) {
				// A generous timeout: on a busy machine Redis's tail latency
				// passes 5ms now and then, which opens the breaker and turns
				// a second of decisions local; this measures the Redis path.
				d := newDecider(b, c, pol, Options{RedisTimeout: 100 * time.Millisecond}, lo)
				run(b, d, bc.endpoint, parallel)
			})
		}
	}

	b.Run("redis-down", func(b *testing.B) {
		down := redistest.Start(b)
		dc := redis.NewClient(&redis.Options{Addr: down.Addr, ContextTimeoutEnabled: true, MaxRetries: -1})
		b.Cleanup(func() { dc.Close() })
		down.Stop()
		d := newDecider(b, dc, pol, Options{RedisTimeout: DefaultRedisTimeout, BreakerCooldown: time.Hour, FailOpenAfter: -1}, lo)
		run(b, d, "/gen", true)
	})
}

// BenchmarkRemember measures remember, the local fallback's bookkeeping
// after every Redis decision, over 100k users of the benchmark plan (three
// token quotas kept per user) plus a tenant-wide month, and reports the
// owners the default bound kept once each user was seen, the heap they
// hold (the user names excluded: they are allocated before), the table's
// size per owner kept (the table is off the heap where it can be mapped),
// and the users still deciding from Redis's remaining after two passes of
// an outage (outageOwners: each user's request rate then needs a state too).
func BenchmarkRemember(b *testing.B) {
	pol := parsePolicy(b, benchPolicy+"tenants:\n  bench: {plan: pro, quotas: [{name: month, kind: calendar_month, limit: 1000000000000}]}\n", "")
	rs, err := pol.Resolve("bench", "", "/any")
	if err != nil {
		b.Fatal(err)
	}
	states := make([]limits.State, len(rs.Subject))
	for i := range rs.Subject {
		states[i] = limits.State{Rule: &rs.Subject[i], Limit: 1e9, Remaining: 1e9, Reset: time.Hour}
	}
	users := make([]string, benchUsers)
	for i := range users {
		users[i] = "u" + strconv.Itoa(i)
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	d := localDecider(b, Options{}) // its table, allocated at its cap, counts
	for _, u := range users {
		d.remember("bench", u, states, d.mono())
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	owners := d.local.owners() // the default bound keeps about all of them
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		d.remember("bench", users[i%benchUsers], states, d.mono())
		i++
	}
	b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(owners), "heapB/owner")
	b.ReportMetric(float64(len(d.local.buckets))*float64(unsafe.Sizeof(bucket{}))/float64(owners), "tableB/owner")
	b.ReportMetric(float64(owners), "owners")
	b.ReportMetric(float64(outageKept(d, rs.Subject, users[benchUsers/2:])), "outageOwners")
}

// outageKept decides each user locally over rules (an outage: its request
// rate is kept beside its quotas) in two passes, and returns how many still
// decide their first quota from what Redis reported, not the allowance.
func outageKept(d *Decider, rules []policy.Rule, users []string) int {
	rules = slices.DeleteFunc(slices.Clone(rules), func(r policy.Rule) bool { return r.Scope != policy.ScopeUser })
	kept := 0
	for pass := range 2 {
		for _, u := range users {
			_, _, _, out := check(d, d.local.owner(ownerKey{scope: policy.ScopeUser, a: "bench", b: u}), rules, 1)
			if pass == 1 && out[0].Remaining > d.opt.UnseenAllowance {
				kept++
			}
		}
	}
	return kept
}
