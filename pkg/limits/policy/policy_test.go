package policy

import (
	"errors"
	"fmt"
	"math"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

// designPolicy is the example of docs/design.md §3, with plan pro filled in.
const designPolicy = `
default_plan: free
plans:
  free:
    quotas:                      # token quotas; cost = estimated/actual tokens
      - {name: 5h,  kind: rolling, window: 5h,   limit: 1000}
      - {name: 7d,  kind: rolling, window: 168h, limit: 5000}
      - {name: 30d, kind: rolling, window: 720h, limit: 10000}
    rates:                       # request rates; cost = 1
      - {name: rps, kind: token_bucket, rate: 5, per: 1s, burst: 10}
  pro:
    quotas:
      - {name: 5h,  kind: rolling, window: 5h,   limit: 20000}
      - {name: 7d,  kind: rolling, window: 168h, limit: 100000}
      - {name: 30d, kind: rolling, window: 720h, limit: 300000}
    rates:
      - {name: rps, kind: token_bucket, rate: 20, per: 1s, burst: 40}
tenants:                         # per-tenant plan defaults and tenant-wide (hierarchical) quotas
  acme: {plan: pro, quotas: [{name: month, kind: calendar_month, limit: 1000000}]}
endpoints:
  /api/v1/generate:
    global: [{name: daily, kind: fixed, window: 24h, limit: 500}]
    user:   [{name: daily, kind: fixed, window: 24h, limit: 15}]
ip: [{name: burst, kind: fixed, window: 5s, limit: 100}]
models:                          # optional cost weights, e.g. output tokens cost 3x
  big-model: {input_weight: 1, output_weight: 3}
`

// ruleString renders a Rule compactly for comparisons: scope, endpoint,
// name, kind, unit, then the fields its kind uses and its shadow flag.
func ruleString(r Rule) string {
	var b strings.Builder
	b.WriteString(string(r.Scope))
	if r.Endpoint != "" {
		b.WriteString("@" + r.Endpoint)
	}
	fmt.Fprintf(&b, ":%s %s %s", r.Name, r.Kind, r.Unit)
	if r.Limit.Limit != 0 {
		fmt.Fprintf(&b, " limit=%d", r.Limit.Limit)
	}
	if r.Window != 0 {
		fmt.Fprintf(&b, " window=%s", time.Duration(r.Window))
	}
	if r.Buckets != 0 {
		fmt.Fprintf(&b, " buckets=%d", r.Buckets)
	}
	if r.Kind == TokenBucket {
		fmt.Fprintf(&b, " rate=%g per=%s burst=%d", r.Rate, time.Duration(r.Per), r.Burst)
	}
	if r.Shadow {
		b.WriteString(" shadow")
	}
	return b.String()
}

func ruleStrings(rs []Rule) []string {
	out := []string{}
	for _, r := range rs {
		out = append(out, ruleString(r))
	}
	return out
}

func mustParse(t testing.TB, src string) *Policy {
	t.Helper()
	p, err := Parse([]byte(src))
	if err != nil {
		t.Fatalf("Parse(%q) error = %v, want nil", src, err)
	}
	return p
}

func TestParseDesignExample(t *testing.T) {
	p := mustParse(t, designPolicy)
	if p.DefaultPlan != "free" || len(p.Plans) != 2 || len(p.Tenants) != 1 || len(p.Endpoints) != 1 {
		t.Fatalf("Parse(design) = %+v, want plans free and pro, tenant acme, one endpoint", p)
	}
	free := p.Plans["free"]
	if got, want := free.Quotas[1].Window, Duration(168*time.Hour); got != want {
		t.Errorf("plans.free.quotas[1].window = %v, want %v", got, want)
	}
	if got := free.Quotas[0]; got.Unit != Tokens || got.Buckets != DefaultBuckets {
		t.Errorf("plans.free.quotas[0] = %+v, want unit tokens and %d buckets filled in", got, DefaultBuckets)
	}
	if got := free.Rates[0]; got.Unit != Requests || got.Rate != 5 || got.Per != Duration(time.Second) || got.Burst != 10 {
		t.Errorf("plans.free.rates[0] = %+v, want requests, rate 5 per 1s, burst 10", got)
	}
	if got, want := p.Models["big-model"], (ModelWeights{InputWeight: 1, OutputWeight: 3}); got != want {
		t.Errorf("models.big-model = %+v, want %+v", got, want)
	}
	if len(p.Digest()) != 64 {
		t.Errorf("Digest() = %q, want 64 hex digits", p.Digest())
	}
	if err := p.Validate(); err != nil {
		t.Errorf("Validate() of a parsed policy = %v, want nil", err)
	}
}

func TestResolveDesignExample(t *testing.T) {
	p := mustParse(t, designPolicy)
	ipRules := []string{"ip:burst fixed requests limit=100 window=5s"}
	genGlobal := []string{"global@/api/v1/generate:daily fixed requests limit=500 window=24h0m0s"}
	free := []string{
		"user:5h rolling tokens limit=1000 window=5h0m0s buckets=24",
		"user:7d rolling tokens limit=5000 window=168h0m0s buckets=24",
		"user:30d rolling tokens limit=10000 window=720h0m0s buckets=24",
		"user:rps token_bucket requests rate=5 per=1s burst=10",
	}
	pro := []string{
		"user:5h rolling tokens limit=20000 window=5h0m0s buckets=24",
		"user:7d rolling tokens limit=100000 window=168h0m0s buckets=24",
		"user:30d rolling tokens limit=300000 window=720h0m0s buckets=24",
		"user:rps token_bucket requests rate=20 per=1s burst=40",
	}
	acme := "tenant:month calendar_month tokens limit=1000000"
	genUser := "user@/api/v1/generate:daily fixed requests limit=15 window=24h0m0s"
	cat := func(parts ...any) []string {
		out := []string{}
		for _, p := range parts {
			switch p := p.(type) {
			case string:
				out = append(out, p)
			case []string:
				out = append(out, p...)
			}
		}
		return out
	}

	tests := []struct {
		tenant, plan, endpoint string
		wantPlan, wantEndpoint string
		global, subject        []string
	}{
		// The tenant's plan, its tenant-wide quota first, then the plan's
		// quotas and rates, then the endpoint's per-user limit.
		{"acme", "", "/api/v1/generate", "pro", "/api/v1/generate", genGlobal, cat(acme, pro, genUser)},
		// An explicit plan beats the tenant's.
		{"acme", "free", "/api/v1/generate", "free", "/api/v1/generate", genGlobal, cat(acme, free, genUser)},
		// An unknown tenant falls back to default_plan.
		{"globex", "", "/api/v1/generate", "free", "/api/v1/generate", genGlobal, cat(free, genUser)},
		{"globex", "pro", "/api/v1/generate", "pro", "/api/v1/generate", genGlobal, cat(pro, genUser)},
		// An undeclared endpoint has no global or per-user limits.
		{"acme", "", "/api/v1/other", "pro", "", nil, cat(acme, pro)},
		{"", "", "", "free", "", nil, cat(free)},
	}
	for _, tt := range tests {
		name := fmt.Sprintf("%s/%s/%s", tt.tenant, tt.plan, tt.endpoint)
		t.Run(name, func(t *testing.T) {
			r, err := p.Resolve(tt.tenant, tt.plan, tt.endpoint)
			if err != nil {
				t.Fatalf("Resolve(%q, %q, %q) error = %v", tt.tenant, tt.plan, tt.endpoint, err)
			}
			if r.Plan != tt.wantPlan || r.Endpoint != tt.wantEndpoint {
				t.Errorf("Resolve(%q, %q, %q) plan, endpoint = %q, %q, want %q, %q",
					tt.tenant, tt.plan, tt.endpoint, r.Plan, r.Endpoint, tt.wantPlan, tt.wantEndpoint)
			}
			check := func(layer string, got []Rule, want []string) {
				if want == nil {
					want = []string{}
				}
				if g := ruleStrings(got); !reflect.DeepEqual(g, want) {
					t.Errorf("Resolve(%q, %q, %q).%s =\n  %s\nwant\n  %s", tt.tenant, tt.plan, tt.endpoint,
						layer, strings.Join(g, "\n  "), strings.Join(want, "\n  "))
				}
			}
			check("IP", r.IP, ipRules)
			check("Global", r.Global, tt.global)
			check("Subject", r.Subject, tt.subject)

			// A policy built in code, without Parse's index, resolves the same.
			slow := *p
			slow.idx = nil
			rs, err := slow.Resolve(tt.tenant, tt.plan, tt.endpoint)
			if err != nil || !reflect.DeepEqual(rs, r) {
				t.Errorf("Resolve without index = %+v, %v, want %+v", rs, err, r)
			}
		})
	}
}

func TestResolveUnknownPlan(t *testing.T) {
	p := mustParse(t, designPolicy)
	_, err := p.Resolve("acme", "gold", "/api/v1/generate")
	if !errors.Is(err, ErrUnknownPlan) || err.Error() != `unknown plan "gold"` {
		t.Errorf(`Resolve("acme", "gold", ...) error = %v, want ErrUnknownPlan: unknown plan "gold"`, err)
	}
}

// grantsPolicy has a tenant on its own plan granting another, one on the
// default plan granting another, and one with only tenant-wide limits.
const grantsPolicy = `
default_plan: free
plans: {free: {}, pro: {}, enterprise: {}}
tenants:
  acme: {plan: pro, plans: [enterprise]}
  beta: {plans: [pro]}
  gamma: {quotas: [{name: month, kind: calendar_month, limit: 10}]}
`

func TestPolicyGrants(t *testing.T) {
	parsed := mustParse(t, grantsPolicy)
	inCode := &Policy{DefaultPlan: "free", Plans: parsed.Plans, Tenants: parsed.Tenants} // no index: the slow path
	for _, tc := range []struct {
		tenant, plan string
		want         bool
	}{
		{"acme", "", true},           // the tenant's own plan
		{"acme", "pro", true},        // its plan
		{"acme", "enterprise", true}, // granted
		{"acme", "free", false},      // default_plan is not acme's plan
		{"beta", "free", true},       // default_plan is beta's own
		{"beta", "pro", true},
		{"beta", "enterprise", false},
		{"gamma", "free", true},
		{"gamma", "pro", false},
		{"unlisted", "free", true},
		{"unlisted", "", true},
		{"unlisted", "pro", false},
		{"acme", "gold", false}, // not a plan at all
	} {
		for name, p := range map[string]*Policy{"parsed": parsed, "built in code": inCode} {
			if got := p.Grants(tc.tenant, tc.plan); got != tc.want {
				t.Errorf("%s: Grants(%q, %q) = %v, want %v", name, tc.tenant, tc.plan, got, tc.want)
			}
		}
	}
	if allocs := testing.AllocsPerRun(100, func() { parsed.Grants("acme", "enterprise") }); allocs != 0 {
		t.Errorf("Grants allocates %v times, want 0", allocs)
	}
	for tenant, want := range map[string][]string{
		"acme": {"pro", "enterprise"}, "beta": {"free", "pro"}, "gamma": {"free"}, "unlisted": {"free"},
	} {
		for name, p := range map[string]*Policy{"parsed": parsed, "built in code": inCode} {
			if got := p.TenantPlans(tenant); !slices.Equal(got, want) {
				t.Errorf("%s: TenantPlans(%q) = %q, want %q", name, tenant, got, want)
			}
		}
	}
}

func TestResolveShadowInheritance(t *testing.T) {
	const src = `
default_plan: trial
plans:
  trial:
    shadow: true
    quotas: [{name: day, kind: fixed, window: 24h, limit: 100}]
  paid:
    quotas:
      - {name: day, kind: fixed, window: 24h, limit: 1000}
      - {name: week, kind: fixed, window: 168h, limit: 5000, shadow: true}
tenants:
  newco: {plan: paid, shadow: true, rates: [{name: rpm, kind: fixed, window: 1m, limit: 600}]}
  oldco: {rates: [{name: rpm, kind: fixed, window: 1m, limit: 600}]}
endpoints:
  /v1/chat:
    global: [{name: g, kind: token_bucket, rate: 100, per: 1s, burst: 200, shadow: true}]
    user: [{name: u, kind: sliding_log, window: 1m, limit: 10}]
`
	p := mustParse(t, src)
	tests := []struct {
		tenant, plan string
		want         []string
	}{
		{"newco", "", []string{
			"tenant:rpm fixed requests limit=600 window=1m0s shadow", // tenant entry is shadow
			"user:day fixed tokens limit=1000 window=24h0m0s",
			"user:week fixed tokens limit=5000 window=168h0m0s shadow", // the limit is shadow
			"user@/v1/chat:u sliding_log requests limit=10 window=1m0s",
		}},
		{"oldco", "", []string{
			"tenant:rpm fixed requests limit=600 window=1m0s",
			"user:day fixed tokens limit=100 window=24h0m0s shadow", // plan trial is shadow
			"user@/v1/chat:u sliding_log requests limit=10 window=1m0s",
		}},
	}
	for _, tt := range tests {
		r, err := p.Resolve(tt.tenant, tt.plan, "/v1/chat")
		if err != nil {
			t.Fatalf("Resolve(%q) error = %v", tt.tenant, err)
		}
		if got := ruleStrings(r.Subject); !reflect.DeepEqual(got, tt.want) {
			t.Errorf("Resolve(%q).Subject =\n  %s\nwant\n  %s", tt.tenant, strings.Join(got, "\n  "), strings.Join(tt.want, "\n  "))
		}
		if got, want := ruleStrings(r.Global), []string{"global@/v1/chat:g token_bucket requests rate=100 per=1s burst=200 shadow"}; !reflect.DeepEqual(got, want) {
			t.Errorf("Resolve(%q).Global = %v, want %v", tt.tenant, got, want)
		}
	}

	// shadow: true on the whole policy makes every rule shadow.
	all := mustParse(t, src+"ip: [{name: b, kind: fixed, window: 1s, limit: 5}]\nshadow: true\n")
	r, err := all.Resolve("oldco", "paid", "/v1/chat")
	if err != nil {
		t.Fatalf("Resolve error = %v", err)
	}
	for _, layer := range [][]Rule{r.IP, r.Global, r.Subject} {
		for _, rule := range layer {
			if !rule.Shadow {
				t.Errorf("rule %s of a shadow policy is not shadow", ruleString(rule))
			}
		}
	}
}

func TestResolveUnits(t *testing.T) {
	const src = `
default_plan: p
plans:
  p:
    quotas:
      - {name: q, kind: fixed, window: 1h, limit: 10}
      - {name: inflight, kind: concurrency, limit: 4}
      - {name: credits, kind: balance}
      - {name: qr, kind: fixed, window: 1h, limit: 10, unit: requests}
    rates:
      - {name: r, kind: fixed, window: 1h, limit: 10}
      - {name: rt, kind: rolling, window: 1h, limit: 10, unit: tokens, buckets: 60}
tenants:
  t: {quotas: [{name: tq, kind: fixed, window: 1h, limit: 10}], rates: [{name: tr, kind: fixed, window: 1h, limit: 10}]}
endpoints:
  /e: {global: [{name: g, kind: fixed, window: 1h, limit: 10}], user: [{name: u, kind: fixed, window: 1h, limit: 10, unit: tokens}]}
ip: [{name: i, kind: sliding_log, window: 1s, limit: 10}]
`
	p := mustParse(t, src)
	r, err := p.Resolve("t", "", "/e")
	if err != nil {
		t.Fatalf("Resolve error = %v", err)
	}
	got := map[string]Unit{}
	for _, layer := range [][]Rule{r.IP, r.Global, r.Subject} {
		for _, rule := range layer {
			got[string(rule.Scope)+":"+rule.Name] = rule.Unit
		}
	}
	want := map[string]Unit{
		"ip:i": Requests, "global:g": Requests, "tenant:tq": Tokens, "tenant:tr": Requests,
		"user:q": Tokens, "user:inflight": Requests, "user:credits": Tokens, "user:qr": Requests,
		"user:r": Requests, "user:rt": Tokens, "user:u": Tokens,
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Resolve units = %v, want %v", got, want)
	}
}

func TestResolveSharesNoBackingArray(t *testing.T) {
	p := mustParse(t, designPolicy)
	r, _ := p.Resolve("acme", "", "/api/v1/generate")
	_ = append(r.Subject, Rule{Limit: Limit{Name: "appended"}})
	_ = append(r.IP, Rule{Limit: Limit{Name: "appended"}})
	r2, _ := p.Resolve("acme", "", "/api/v1/generate")
	if !reflect.DeepEqual(r, r2) {
		t.Errorf("an append by a caller changed the policy's rules: %+v, want %+v", r2, r)
	}
}

func TestResolveAllocs(t *testing.T) {
	p := mustParse(t, designPolicy)
	for _, args := range [][3]string{
		{"acme", "", "/api/v1/generate"},
		{"acme", "free", "/api/v1/generate"},
		{"u-1", "", "/api/v1/generate"},
		{"u-1", "", "/unknown"},
	} {
		allocs := testing.AllocsPerRun(100, func() {
			if _, err := p.Resolve(args[0], args[1], args[2]); err != nil {
				t.Fatal(err)
			}
		})
		if allocs != 0 {
			t.Errorf("Resolve%q allocates %v times, want 0", args, allocs)
		}
	}
}

func BenchmarkResolve(b *testing.B) {
	p := mustParse(b, designPolicy)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := p.Resolve("acme", "", "/api/v1/generate"); err != nil {
			b.Fatal(err)
		}
	}
}

func TestPolicyPrecomputeBudget(t *testing.T) {
	// More tenant, plan and endpoint combinations than are precomputed: the
	// rest are assembled per call and must equal the slow path.
	var b strings.Builder
	b.WriteString("default_plan: p0\nplans:\n")
	for i := range 20 {
		fmt.Fprintf(&b, "  p%d: {quotas: [{name: q, kind: fixed, window: 1h, limit: %d}]}\n", i, i+1)
	}
	b.WriteString("endpoints:\n")
	for i := range 30 {
		fmt.Fprintf(&b, "  /e%d: {user: [{name: u, kind: fixed, window: 1h, limit: 5}]}\n", i)
	}
	b.WriteString("tenants:\n")
	for i := range 30 {
		fmt.Fprintf(&b, "  t%d: {plan: p%d, quotas: [{name: tq, kind: fixed, window: 1h, limit: 9}, {name: tq2, kind: fixed, window: 1m, limit: 9}]}\n", i, i%20)
	}
	p := mustParse(t, b.String())
	rules := 0
	for _, s := range p.idx.subjects {
		rules += 1 + len(s)
	}
	if rules > maxPrecomputed || rules < maxPrecomputed-4 || len(p.idx.subjects) == 20*31*31 {
		t.Errorf("precomputed %d subject lists of %d rules in all, want the cap of %d rules reached", len(p.idx.subjects), rules, maxPrecomputed)
	}
	slow := *p
	slow.idx = nil
	for _, tenant := range []string{"t0", "t29", "nobody"} {
		for _, plan := range []string{"", "p0", "p19"} {
			for _, ep := range []string{"/e0", "/e29", "/none"} {
				r, err1 := p.Resolve(tenant, plan, ep)
				rs, err2 := slow.Resolve(tenant, plan, ep)
				if err1 != nil || err2 != nil || !reflect.DeepEqual(r, rs) {
					t.Errorf("Resolve(%q, %q, %q) = %+v, %v; without index %+v, %v", tenant, plan, ep, r, err1, rs, err2)
				}
			}
		}
	}
}

func TestPolicyLongestTokenWindow(t *testing.T) {
	tests := []struct {
		name, src string
		want      time.Duration
	}{
		{"design", designPolicy, 31 * 24 * time.Hour}, // acme's calendar month beats 720h
		{"rolling", "default_plan: p\nplans: {p: {quotas: [{name: a, kind: rolling, window: 720h, limit: 1}, {name: b, kind: fixed, window: 1h, limit: 1}]}}", 720 * time.Hour},
		{"requests only", "default_plan: p\nplans: {p: {rates: [{name: a, kind: fixed, window: 720h, limit: 1}]}}", 0},
		{"bucket refill", "default_plan: p\nplans: {p: {quotas: [{name: a, kind: token_bucket, rate: 100, per: 1m, burst: 6000}]}}", time.Hour},
		{"allowance", "default_plan: p\nplans: {p: {quotas: [{name: a, kind: token_bucket, per: 24h, burst: 15}]}}", 24 * time.Hour},
		{"no limits", "default_plan: p\nplans: {p: {}}", 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := mustParse(t, tt.src)
			if got := p.LongestTokenWindow(); got != tt.want {
				t.Errorf("LongestTokenWindow() = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestCost(t *testing.T) {
	p := mustParse(t, `
default_plan: p
plans: {p: {}}
models:
  big-model: {input_weight: 1, output_weight: 3}
  tenth: {input_weight: 0.1, output_weight: 0.1}
  half: {input_weight: 0.5, output_weight: 0}
  output-only: {output_weight: 2}
`)
	tests := []struct {
		model         string
		input, output int64
		want          int64
	}{
		{"unlisted", 100, 50, 150},
		{"big-model", 100, 10, 130},
		{"tenth", 30, 0, 3}, // 30×0.1 is 3.0000000000000004 in floating point
		{"tenth", 31, 0, 4}, // 3.1 rounds up
		{"tenth", 1, 1, 1},  // 0.2 rounds up
		{"half", 3, 1000, 2},
		{"output-only", 10, 10, 30}, // a weight left out in YAML is 1
		{"big-model", -5, -1, 0},
		{"unlisted", math.MaxInt64, 1, math.MaxInt64},
		{"big-model", math.MaxInt64 / 2, math.MaxInt64 / 2, math.MaxInt64},
		{"big-model", 0, 0, 0},
	}
	for _, tt := range tests {
		if got := p.Cost(tt.model, tt.input, tt.output); got != tt.want {
			t.Errorf("Cost(%q, %d, %d) = %d, want %d", tt.model, tt.input, tt.output, got, tt.want)
		}
	}
}

func TestPolicyDeployFile(t *testing.T) {
	p, err := LoadFile("../../../deploy/policy.yaml")
	if err != nil {
		t.Fatalf("LoadFile(deploy/policy.yaml) error = %v", err)
	}
	r, err := p.Resolve("acme", "", "/api/v1/generate")
	if err != nil {
		t.Fatalf("Resolve(acme) error = %v", err)
	}
	if r.Plan != "pro" || len(r.IP) != 1 || len(r.Global) != 1 || len(r.Subject) != 6 {
		t.Errorf("Resolve(acme) = plan %q with %d ip, %d global, %d subject rules; want pro, 1, 1, 6",
			r.Plan, len(r.IP), len(r.Global), len(r.Subject))
	}
	for _, plan := range []string{"free", "pro"} {
		var names []string
		for _, l := range p.Plans[plan].Quotas {
			names = append(names, l.Name+"/"+string(l.Kind))
		}
		if got, want := strings.Join(names, " "), "5h/rolling 7d/rolling 30d/rolling"; got != want {
			t.Errorf("deploy plan %s quotas = %s, want %s", plan, got, want)
		}
		if rates := p.Plans[plan].Rates; len(rates) != 1 || rates[0].Kind != TokenBucket {
			t.Errorf("deploy plan %s rates = %+v, want one token bucket", plan, rates)
		}
	}
	if got := p.Cost("big-model", 10, 10); got != 40 {
		t.Errorf("deploy Cost(big-model, 10, 10) = %d, want 40", got)
	}
}

func TestLimitAlertThresholds(t *testing.T) {
	p, err := Parse([]byte(`default_plan: free
plans:
  free:
    quotas:
      - {name: tokens5h, kind: rolling, window: 5h, limit: 1000}
      - {name: tokbucket, kind: token_bucket, rate: 10, per: 1s, burst: 100}
      - {name: credits, kind: balance}
      - {name: quiet, kind: rolling, window: 5h, limit: 1000, alerts: []}
    rates:
      - {name: rps, kind: token_bucket, rate: 10, per: 1s, burst: 10}
      - {name: inflight, kind: concurrency, limit: 4}
      - {name: minute, kind: fixed, window: 1m, limit: 60}
      - {name: hour, kind: fixed, window: 1h, limit: 600}
      - {name: day, kind: sliding_log, window: 24h, limit: 1000}
      - {name: month, kind: calendar_month, limit: 10000}
      - {name: custom, kind: token_bucket, rate: 1, per: 1s, burst: 10, alerts: [50, 100]}
`))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][]int{
		"tokens5h": {80, 90, 100}, "tokbucket": nil, "credits": {80, 90, 100}, "quiet": {},
		"rps": nil, "inflight": nil, "minute": nil, "hour": {80, 90, 100}, "day": {80, 90, 100},
		"month": {80, 90, 100}, "custom": {50, 100},
	}
	pl := p.Plans["free"]
	for _, l := range slices.Concat(pl.Quotas, pl.Rates) {
		got := l.AlertThresholds()
		if !slices.Equal(got, want[l.Name]) {
			t.Errorf("%s: AlertThresholds() = %v, want %v", l.Name, got, want[l.Name])
		}
	}
}

// Every rule Resolve returns keeps its ID, the hash of its own fields (a
// kept id of another rule would charge that rule's record in Redis), and a
// reload that changes what identifies a limit gives it a new one.
func TestResolvedRulesKeepTheirID(t *testing.T) {
	ids := func(src string) map[string]int64 {
		r, err := mustParse(t, src).Resolve("acme", "", "/api/v1/generate")
		if err != nil {
			t.Fatalf("Resolve error = %v", err)
		}
		out := map[string]int64{}
		for _, layer := range [][]Rule{r.IP, r.Global, r.Subject} {
			for _, rule := range layer {
				built := rule
				built.id = 0
				if rule.id == 0 || rule.ID() != built.ID() {
					t.Errorf("%s: kept id %#x, its fields hash to %#x", ruleString(rule), rule.id, built.ID())
				}
				out[ruleString(rule)] = rule.ID()
			}
		}
		return out
	}
	before := ids(designPolicy)
	if len(before) < 4 {
		t.Fatalf("resolved %d rules, want at least 4", len(before))
	}
	burst, ok := before["ip:burst fixed requests limit=100 window=5s"]
	if !ok {
		t.Fatalf("no ip limit burst among %v", before)
	}
	after := ids(strings.Replace(designPolicy, "window: 5s", "window: 6s", 1))
	for s, id := range after {
		if strings.HasPrefix(s, "ip:burst") {
			if id == burst {
				t.Errorf("%s kept the id of its 5s window %#x", s, id)
			}
		} else if before[s] != id {
			t.Errorf("%s: id %#x after the reload, %#x before", s, id, before[s])
		}
	}
}
