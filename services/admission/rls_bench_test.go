package main

import (
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlspb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
)

// BenchmarkShouldRateLimit is ShouldRateLimit with one and with five
// descriptors over one gRPC connection, on the real Redis and NATS behind
// the whole of run, from 8 goroutines per CPU; every call is of one
// of 10k users, allowed. proc-cpu-us/op is the process's CPU per call
// (processCPU), steadier than ns/op on a shared host. The CPU and allocations
// include the client's: compare runs, not the figures with bench-rls's
// server-only CPU.
//
//	go test -run '^$' -bench ShouldRateLimit -count 6 ./services/admission
func BenchmarkShouldRateLimit(b *testing.B) {
	// bench/admitload -rls's configuration, on a domain of its own.
	conf, err := os.ReadFile("internal/rls/testdata/windows.yaml")
	if err != nil {
		b.Fatal(err)
	}
	r := startRLSWith(b, "rlsbench", strings.Replace(string(conf), "\ndomain: bench\n", "\ndomain: %s\n", 1), nil)
	ctx := bearer(gatewayToken)
	var n atomic.Int64
	for _, c := range []struct {
		name    string
		windows []string
	}{{"one", nil}, {"five", []string{"second", "minute", "day", "month"}}} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetParallelism(8) // 16 calls in flight on 2 cores, as bench-rls's lower level
			cpu := processCPU(b)
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
			b.ReportMetric((processCPU(b)-cpu)*1e6/float64(b.N), "proc-cpu-us/op")
		})
	}
}
