package envoypeer

import (
	"fmt"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlspb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
)

// BenchWindows are the windows of BenchConfig besides the hour, in the
// order BenchRequest names them.
var BenchWindows = []string{"second", "minute", "day", "month"}

// BenchConfig is the envoyproxy/ratelimit configuration of the RLS
// benchmarks (bench/admitload -rls, which both servers load, admission's
// BenchmarkShouldRateLimit, rls's allocation guard) for domain: per tenant
// and user an hourly limit and one per BenchWindows entry, each named by a
// third entry (key window), sized never to deny.
func BenchConfig(domain string) string {
	s := "domain: " + domain + `
descriptors:
  - key: tenant
    descriptors:
      - key: user
        rate_limit: {unit: hour, requests_per_unit: 1000000000}
        descriptors:
`
	for _, w := range BenchWindows {
		s += fmt.Sprintf("          - {key: window, value: %s, rate_limit: {unit: %s, requests_per_unit: 1000000000}}\n", w, w)
	}
	return s
}

// BenchRequest is a ShouldRateLimit request of BenchConfig's domain for
// tenant "bench" and user with n descriptors (1 to 5): the user's, then
// the first n-1 windows.
func BenchRequest(domain, user string, n int) *rlspb.RateLimitRequest {
	d := func(extra ...string) *rlv3.RateLimitDescriptor {
		es := []*rlv3.RateLimitDescriptor_Entry{{Key: "tenant", Value: "bench"}, {Key: "user", Value: user}}
		if len(extra) > 0 {
			es = append(es, &rlv3.RateLimitDescriptor_Entry{Key: "window", Value: extra[0]})
		}
		return &rlv3.RateLimitDescriptor{Entries: es}
	}
	req := &rlspb.RateLimitRequest{Domain: domain, Descriptors: []*rlv3.RateLimitDescriptor{d()}}
	for _, w := range BenchWindows[:n-1] {
		req.Descriptors = append(req.Descriptors, d(w))
	}
	return req
}
