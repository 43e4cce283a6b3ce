package rls

import (
	"context"
	"fmt"
	"testing"

	rlspb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"

	"quotaflow/internal/auth"
	"quotaflow/internal/envoypeer"
	"quotaflow/pkg/limits/policy"
	"quotaflow/services/admission/internal/decide"
	"quotaflow/services/admission/internal/grpcapi"
	"quotaflow/services/admission/internal/rlsconf"
)

// allowAll is a Checker that allows every charge with the whole limit
// left.
type allowAll struct{ res decide.Result }

func (a *allowAll) Check(_ context.Context, charges []decide.Charge) (decide.Result, error) {
	a.res.Allowed, a.res.Limits = true, a.res.Limits[:0]
	for _, c := range charges {
		r := c.Rules[0]
		a.res.Limits = append(a.res.Limits, decide.LimitState{Scope: policy.ScopeGlobal, Name: r.Name,
			Limit: r.Limit.Limit, Remaining: r.Limit.Limit - c.Cost, Reset: 1})
	}
	return a.res, nil
}

// ShouldRateLimit's own allocations (checking, the charges' keys, the
// reply), without the decision's or gRPC's, stay under a bound per
// descriptor: a guard against a regression on issue 14's path, not a
// measurement (bench/results.md has those).
func TestShouldRateLimitAllocations(t *testing.T) {
	cfg, err := rlsconf.Parse(rlsconf.File{Name: "bench.yaml", Data: []byte(envoypeer.BenchConfig("bench"))})
	if err != nil {
		t.Fatal(err)
	}
	h, err := New(Options{Checker: &allowAll{}, Config: func() *rlsconf.Config { return cfg },
		TenantKeys: []string{"tenant"}, UserKeys: []string{"user"}, Headers: true})
	if err != nil {
		t.Fatal(err)
	}
	tokens, err := auth.New(auth.Options{Tokens: []string{"gw#gateway"}})
	if err != nil {
		t.Fatal(err)
	}
	p, _ := tokens.AuthenticateHeader("Bearer gw")
	ctx := grpcapi.NewContext(context.Background(), p.As(auth.Gateway))
	for _, c := range []struct {
		name string
		n    int
		max  float64
	}{
		{"one", 1, 8},
		{"five", 5, 20},
	} {
		req := envoypeer.BenchRequest("bench", "u1", c.n)
		var resp *rlspb.RateLimitResponse
		n := testing.AllocsPerRun(100, func() {
			if resp, err = h.ShouldRateLimit(ctx, req); err != nil {
				t.Fatal(err)
			}
		})
		if got := fmt.Sprint(resp.GetOverallCode(), len(resp.GetStatuses())); got != fmt.Sprint(rlspb.RateLimitResponse_OK, c.n) {
			t.Fatalf("%s: ShouldRateLimit = %v", c.name, resp)
		}
		if n > c.max {
			t.Errorf("%s: ShouldRateLimit allocates %v times, want at most %v", c.name, n, c.max)
		}
		t.Logf("%s: %v allocations", c.name, n)
	}
}
