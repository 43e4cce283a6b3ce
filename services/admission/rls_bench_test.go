package main

import (
	"strconv"
	"sync/atomic"
	"testing"

	rlspb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"

	"quotaflow/internal/envoypeer"
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
	// bench/admitload -rls's configuration, on a domain of its own
	// (startRLSWith fills in %s).
	r := startRLSWith(b, "rlsbench", envoypeer.BenchConfig("%s"), nil)
	ctx := bearer(gatewayToken)
	var n atomic.Int64
	for _, c := range []struct {
		name string
		n    int
	}{{"one", 1}, {"five", 5}} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetParallelism(8) // 16 calls in flight on 2 cores, as bench-rls's lower level
			cpu := processCPU(b)
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					req := envoypeer.BenchRequest(r.domain, "u"+strconv.FormatInt(n.Add(1)%10_000, 10), c.n)
					resp, err := r.client.ShouldRateLimit(ctx, req)
					if err != nil || resp.GetOverallCode() != rlspb.RateLimitResponse_OK || len(resp.GetStatuses()) != c.n {
						b.Fatalf("ShouldRateLimit = %v, %v", resp, err)
					}
				}
			})
			b.ReportMetric((processCPU(b)-cpu)*1e6/float64(b.N), "proc-cpu-us/op")
		})
	}
}
