package rls

import (
	"context"
	"fmt"
	"os"
	"testing"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlspb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"

	"quotaflow/pkg/limits/policy"
	"quotaflow/services/admission/internal/auth"
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
	data, err := os.ReadFile("testdata/windows.yaml")
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := rlsconf.Parse(rlsconf.File{Name: "windows.yaml", Data: data})
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
	entries := func(extra ...string) *rlv3.RateLimitDescriptor {
		d := &rlv3.RateLimitDescriptor{Entries: []*rlv3.RateLimitDescriptor_Entry{{Key: "tenant", Value: "acme"}, {Key: "user", Value: "u1"}}}
		if len(extra) > 0 {
			d.Entries = append(d.Entries, &rlv3.RateLimitDescriptor_Entry{Key: "window", Value: extra[0]})
		}
		return d
	}
	for _, c := range []struct {
		name string
		ds   []*rlv3.RateLimitDescriptor
		max  float64
	}{
		{"one", []*rlv3.RateLimitDescriptor{entries()}, 16},
		{"five", []*rlv3.RateLimitDescriptor{entries(), entries("second"), entries("minute"), entries("day"), entries("month")}, 24},
	} {
		req := &rlspb.RateLimitRequest{Domain: "bench", Descriptors: c.ds}
		var resp *rlspb.RateLimitResponse
		n := testing.AllocsPerRun(100, func() {
			if resp, err = h.ShouldRateLimit(ctx, req); err != nil {
				t.Fatal(err)
			}
		})
		if got := fmt.Sprint(resp.GetOverallCode(), len(resp.GetStatuses())); got != fmt.Sprint(rlspb.RateLimitResponse_OK, len(c.ds)) {
			t.Fatalf("%s: ShouldRateLimit = %v", c.name, resp)
		}
		if n > c.max {
			t.Errorf("%s: ShouldRateLimit allocates %v times, want at most %v", c.name, n, c.max)
		}
		t.Logf("%s: %v allocations", c.name, n)
	}
}
