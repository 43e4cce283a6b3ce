package limits_test

import (
	"strconv"
	"testing"
	"time"

	"quotaflow/internal/limitstest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits/policy"
)

// A tenant-wide fixed request window shared by a counted user and a blob user:
// the window must admit its limit once, not once per store.
func TestCountedTenantWindowInOneStore(t *testing.T) {
	l := limitstest.At(redistest.Shared(t), 0)
	tenant := redistest.UniqueName(t)
	hour := policy.Duration(time.Hour)
	tw := limitstest.Rule(policy.ScopeTenant, policy.Limit{Name: "tenant", Kind: policy.Fixed, Unit: policy.Requests, Limit: 3, Window: hour})
	counted := []policy.Rule{tw}
	mixed := []policy.Rule{tw, limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "tokens", Kind: policy.Rolling, Limit: 1000, Window: hour})}
	n := 0
	for i := range 10 {
		if limitstest.Reserve(t, l, tenant, "a", "a"+strconv.Itoa(i), 1, counted).Allowed {
			n++
		}
		if limitstest.Reserve(t, l, tenant, "b", "b"+strconv.Itoa(i), 1, mixed).Allowed {
			n++
		}
	}
	if n != 3 {
		t.Fatalf("tenant window of 3 admitted %d", n)
	}
}

// One user's plan window, reached through two endpoints: one with an
// endpoint per-user token limit (blob), one without (counters).
func TestCountedUserWindowInOneStore(t *testing.T) {
	l := limitstest.At(redistest.Shared(t), 0)
	tenant := redistest.UniqueName(t)
	hour := policy.Duration(time.Hour)
	pw := limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "hour", Kind: policy.Fixed, Unit: policy.Requests, Limit: 3, Window: hour})
	ep := limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "tok", Kind: policy.Rolling, Limit: 1000, Window: hour})
	ep.Endpoint = "chat"
	plain := []policy.Rule{pw}
	chat := []policy.Rule{pw, ep}
	n := 0
	for i := range 10 {
		if limitstest.Reserve(t, l, tenant, "u", "p"+strconv.Itoa(i), 1, plain).Allowed {
			n++
		}
		if limitstest.Reserve(t, l, tenant, "u", "c"+strconv.Itoa(i), 1, chat).Allowed {
			n++
		}
	}
	if n != 3 {
		t.Fatalf("user window of 3 admitted %d", n)
	}
}
