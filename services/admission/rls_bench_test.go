package main

import (
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlspb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
)

// rlsBenchConfig is bench/admitload -rls's configuration: per tenant and
// user an hourly limit and four more windows, each named by a third
// entry, sized never to deny.
const rlsBenchConfig = `domain: %s
descriptors:
  - key: tenant
    descriptors:
      - key: user
        rate_limit: {unit: hour, requests_per_unit: 1000000000}
        descriptors:
          - {key: window, value: second, rate_limit: {unit: second, requests_per_unit: 1000000000}}
          - {key: window, value: minute, rate_limit: {unit: minute, requests_per_unit: 1000000000}}
          - {key: window, value: day, rate_limit: {unit: day, requests_per_unit: 1000000000}}
          - {key: window, value: month, rate_limit: {unit: month, requests_per_unit: 1000000000}}
`

// BenchmarkShouldRateLimit is ShouldRateLimit with one and with five
// descriptors over one gRPC connection, on the real Redis and NATS behind
// the whole of run, from 8 goroutines per CPU; every call is of one
// of 10k users, allowed. cpu-ns/op is the process's CPU time (getrusage)
// per call, steadier than ns/op on a shared host. The CPU and allocations
// include the client's: compare runs, not the figures with bench-rls's
// server-only CPU.
//
//	go test -run '^$' -bench ShouldRateLimit -count 6 ./services/admission
func BenchmarkShouldRateLimit(b *testing.B) {
	r := startRLSWith(b, "rlsbench", rlsBenchConfig, nil)
	ctx := bearer(gatewayToken)
	var n atomic.Int64
	for _, c := range []struct {
		name    string
		windows []string
	}{{"one", nil}, {"five", []string{"second", "minute", "day", "month"}}} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetParallelism(8) // 16 calls in flight on 2 cores, as bench-rls's lower level
			cpu := cpuTime(b)
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					u := "u" + strconv.FormatInt(n.Add(1)%10_000, 10)
					req := &rlspb.RateLimitRequest{Domain: r.domain, Descriptors: []*rlv3.RateLimitDescriptor{desc("tenant", "bench", "user", u)}}
					for _, w := range c.windows {
						req.Descriptors = append(req.Descriptors, desc("tenant", "bench", "user", u, "window", w))
					}
					resp, err := r.client.ShouldRateLimit(ctx, req)
					if err != nil || resp.GetOverallCode() != rlspb.RateLimitResponse_OK || len(resp.GetStatuses()) != 1+len(c.windows) {
						b.Fatalf("ShouldRateLimit = %v, %v", resp, err)
					}
				}
			})
			b.ReportMetric(float64(cpuTime(b)-cpu)/float64(b.N), "cpu-ns/op")
		})
	}
}

// cpuTime is the CPU time the process has used, user and system.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
