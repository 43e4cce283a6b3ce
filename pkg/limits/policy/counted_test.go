package policy

import "testing"

// TestResolvedCounted: a tenant is counted only when every list its
// requests can resolve to (every plan, every endpoint) is fixed windows of
// requests, so all its requests agree on where a window lives.
func TestResolvedCounted(t *testing.T) {
	for _, c := range []struct {
		name, yaml string
		want       map[string]bool // tenant: Resolved.Counted on every plan and endpoint
	}{
		{"all fixed requests", `
default_plan: a
plans:
  a: {rates: [{name: m, kind: fixed, window: 1m, limit: 5}]}
tenants:
  ok: {rates: [{name: h, kind: fixed, window: 1h, limit: 9}]}
  tok: {quotas: [{name: d, kind: fixed, unit: tokens, window: 24h, limit: 9}]}
`, map[string]bool{"": true, "ok": true, "tok": false, "unlisted": true}},
		{"another plan keeps tokens", `
default_plan: a
plans:
  a: {rates: [{name: m, kind: fixed, window: 1m, limit: 5}]}
  b: {rates: [{name: t, kind: rolling, unit: tokens, window: 1h, limit: 5}]}
tenants:
  ok: {plan: a}
`, map[string]bool{"": false, "ok": false, "unlisted": false}},
		{"an endpoint keeps tokens", `
default_plan: a
plans:
  a: {rates: [{name: m, kind: fixed, window: 1m, limit: 5}]}
endpoints:
  /chat: {user: [{name: t, kind: rolling, unit: tokens, window: 1h, limit: 5}]}
  /embed: {}
`, map[string]bool{"": false, "unlisted": false}},
	} {
		p, err := Parse([]byte(c.yaml))
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		slow := *p
		slow.idx = nil
		for tenant, want := range c.want {
			for _, ep := range []string{"", "/chat", "/embed"} {
				for _, q := range []*Policy{p, &slow} {
					r, err := q.Resolve(tenant, "", ep)
					if err != nil || r.Counted != want {
						t.Errorf("%s: Resolve(%q, \"\", %q).Counted = %v, %v; want %v", c.name, tenant, ep, r.Counted, err, want)
					}
				}
			}
		}
	}
}
