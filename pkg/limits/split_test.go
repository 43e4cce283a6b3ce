package limits_test

import (
	"strconv"
	"testing"
	"time"

	"quotaflow/internal/limitstest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
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
	if n := alternate(t, l, tenant, side{"a", "a", counted}, side{"b", "b", mixed}); n != 3 {
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
	if n := alternate(t, l, tenant, side{"u", "p", plain}, side{"u", "c", chat}); n != 3 {
		t.Fatalf("user window of 3 admitted %d", n)
	}
}

// side is one of the two kinds of request alternate sends: its user, its
// request ids' prefix and its rules.
type side struct {
	user, prefix string
	rules        []policy.Rule
}

// alternate reserves 1 ten times on each side in turn and returns how many
// were allowed.
func alternate(t *testing.T, l *limits.Limiter, tenant string, x, y side) int {
	n := 0
	for i := range 10 {
		for _, s := range [2]side{x, y} {
			if limitstest.Reserve(t, l, tenant, s.user, s.prefix+strconv.Itoa(i), 1, s.rules).Allowed {
				n++
			}
		}
	}
	return n
}
