package policy

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"time"
)

// ErrUnknownPlan means a request named a plan the policy does not define.
// Resolve wraps it with the plan's name; callers test it with errors.Is and
// answer 400, since the caller sent a bad plan.
var ErrUnknownPlan = errors.New("unknown plan")

// Resolved is every rule that applies to one request, grouped by layer in
// the order admission checks them: IP, then Global, then Subject. The
// slices belong to the Policy and are shared by every request that resolves
// the same way: read them, never modify them (appending copies, since their
// capacity equals their length).
type Resolved struct {
	// Plan is the plan applied: the request's, else the tenant's, else the
	// policy's default_plan.
	Plan string
	// Endpoint is the request's endpoint when the policy declares it, else
	// "" (a metrics label would then say "other").
	Endpoint string
	// IP holds the ip limits (ScopeIP), counted per client address.
	IP []Rule
	// Global holds the endpoint's global limits (ScopeGlobal, Endpoint set),
	// shared by every caller.
	Global []Rule
	// Subject holds the limits of the (tenant, user) pair, which reserve
	// together in one atomic call: the tenant-wide quotas then rates
	// (ScopeTenant), then the plan's quotas, its rates and the endpoint's
	// per-user limits (ScopeUser; Endpoint set on the last).
	Subject []Rule
	// Counted reports that every Subject list any request of this tenant
	// can resolve to (every plan, since a caller not bound to the tenant may
	// name any, with every endpoint and none) is fixed windows of requests
	// alone, so all of them may keep their windows in counters
	// (limits.Request.Counted): a limit is then never in counters for some
	// requests and in a blob for others. A reload that changes it moves the
	// tenant's windows (a plan changing shape, docs/design.md §4).
	Counted bool
}

// maxPrecomputed bounds how many rules, over all Subject lists, Parse builds
// ahead (about 150 bytes each, so 5 MB), so that a policy with many plans,
// endpoints and tenants with tenant-wide limits stays small in memory. Lists
// for tenants without tenant-wide limits come first, then each such tenant
// on its own plan, then on the other plans; a combination left out is
// assembled per call, which costs one allocation.
const maxPrecomputed = 1 << 15

// subjectKey names one precomputed Subject list. tenant is empty for a tenant
// without tenant-wide limits and endpoint for an endpoint without per-user
// limits, since those contribute nothing.
type subjectKey struct{ tenant, plan, endpoint string }

type tenantEntry struct {
	plan    string   // the tenant's plan, or "" for default_plan
	plans   []string // the other plans it grants (Grants)
	rules   []Rule   // tenant-wide rules
	counted bool     // Resolved.Counted
}

type endpointEntry struct {
	global  []Rule
	hasUser bool
}

// policyIndex is what Parse precomputes so that Resolve only looks up maps.
type policyIndex struct {
	digest    string
	ip        []Rule
	tenants   map[string]tenantEntry
	endpoints map[string]endpointEntry
	subjects  map[subjectKey][]Rule
	longest   time.Duration
	counted   bool // Resolved.Counted of a tenant without an entry
}

// Resolve returns the rules that apply to a request of tenant to endpoint,
// on plan if not empty, else on the tenant's plan, else on default_plan. An
// explicit plan the policy does not define is an error wrapping
// ErrUnknownPlan; an unknown tenant simply has no tenant-wide limits and an
// undeclared endpoint no global or per-user limits.
//
// Every Rule has its Unit set, Buckets set for rolling limits and Shadow set
// when its limit, its plan (plan limits), its tenant entry (tenant limits)
// or the whole policy is shadow. On a policy from Parse, Resolve does not
// allocate; it is safe for concurrent use.
func (p *Policy) Resolve(tenant, plan, endpoint string) (Resolved, error) {
	ix := p.idx
	if ix == nil {
		return p.resolveSlow(tenant, plan, endpoint)
	}
	te, listed := ix.tenants[tenant]
	if plan == "" {
		plan = p.DefaultPlan
		if te.plan != "" {
			plan = te.plan
		}
	}
	pl, ok := p.Plans[plan]
	if !ok {
		return Resolved{}, fmt.Errorf("%w %q", ErrUnknownPlan, plan)
	}
	r := Resolved{Plan: plan, IP: ix.ip, Counted: ix.counted}
	key := subjectKey{plan: plan}
	if len(te.rules) > 0 {
		key.tenant = tenant
	}
	if listed {
		r.Counted = te.counted
	}
	ee, declared := ix.endpoints[endpoint]
	if declared {
		r.Endpoint = endpoint
		r.Global = ee.global
		if ee.hasUser {
			key.endpoint = endpoint
		}
	}
	s, ok := ix.subjects[key]
	if !ok {
		s = p.subjectRules(te.rules, pl, key.endpoint, p.Endpoints[key.endpoint])
	}
	r.Subject = s
	return r, nil
}

// Grants reports whether a caller whose API token is bound to tenant may
// name plan in a request: the tenant's own plan (its plan, else
// default_plan; an empty plan means that one) and every plan its plans list
// names. Callers not bound to a tenant may name any plan; admission answers
// 403 to the others (docs/design.md §4). An unknown tenant is granted default_plan
// only. On a policy from Parse it is one map lookup and does not allocate;
// it is safe for concurrent use.
func (p *Policy) Grants(tenant, plan string) bool {
	if plan == "" {
		return true
	}
	own, others := p.grantsOf(tenant)
	return plan == own || slices.Contains(others, plan)
}

// TenantPlans lists the plans Grants grants tenant, each once: its own
// first, then the others in the order its plans list names them.
func (p *Policy) TenantPlans(tenant string) []string {
	own, others := p.grantsOf(tenant)
	out := []string{own}
	for _, pl := range others {
		if !slices.Contains(out, pl) {
			out = append(out, pl)
		}
	}
	return out
}

// grantsOf returns tenant's own plan (its plan, else default_plan) and the
// others its plans list names.
func (p *Policy) grantsOf(tenant string) (own string, others []string) {
	if ix := p.idx; ix != nil {
		te := ix.tenants[tenant]
		own, others = te.plan, te.plans
	} else if t := p.Tenants[tenant]; t != nil {
		own, others = t.Plan, t.Plans
	}
	if own == "" {
		own = p.DefaultPlan
	}
	return own, others
}

// resolveSlow is Resolve for a Policy built in code, without an index.
func (p *Policy) resolveSlow(tenant, plan, endpoint string) (Resolved, error) {
	t := p.Tenants[tenant]
	if plan == "" {
		plan = p.DefaultPlan
		if t != nil && t.Plan != "" {
			plan = t.Plan
		}
	}
	pl, ok := p.Plans[plan]
	if !ok {
		return Resolved{}, fmt.Errorf("%w %q", ErrUnknownPlan, plan)
	}
	r := Resolved{Plan: plan, IP: p.ipRules()}
	e, declared := p.Endpoints[endpoint]
	if declared {
		r.Endpoint = endpoint
		r.Global = p.globalRules(endpoint, e)
	}
	tr := p.tenantRules(t)
	r.Subject = p.subjectRules(tr, pl, r.Endpoint, e)
	r.Counted = p.planWindowsCounted() && requestWindows(tr)
	return r, nil
}

// planWindowsCounted reports whether every plan's limits and every
// endpoint's per-user limits are fixed windows of requests: then any
// tenant whose own limits are too is Resolved.Counted.
func (p *Policy) planWindowsCounted() bool {
	for _, pl := range p.Plans {
		if !requestWindows(p.subjectRules(nil, pl, "", nil)) {
			return false
		}
	}
	for name, e := range p.Endpoints {
		if !requestWindows(p.subjectRules(nil, nil, name, e)) {
			return false
		}
	}
	return true
}

// requestWindows reports whether every rule is a fixed window of requests.
func requestWindows(rules []Rule) bool {
	for i := range rules {
		if r := &rules[i]; r.Kind != Fixed || r.Unit != Requests {
			return false
		}
	}
	return true
}

// makeRule binds a limit to its scope, with defaults and inherited shadow.
func makeRule(l Limit, ll limitList, scope Scope, endpoint string, shadow bool) Rule {
	l.Unit = effectiveUnit(&l, ll.defaultUnit)
	if l.Kind == Rolling && l.Buckets == 0 {
		l.Buckets = DefaultBuckets
	}
	l.Shadow = l.Shadow || shadow
	r := Rule{Limit: l, Scope: scope, Endpoint: endpoint}
	r.id = r.hashID()
	return r
}

func (p *Policy) ipRules() []Rule {
	var out []Rule
	for _, l := range p.IP {
		out = append(out, makeRule(l, ipLimits, ScopeIP, "", p.Shadow))
	}
	return slices.Clip(out)
}

func (p *Policy) globalRules(endpoint string, e *Endpoint) []Rule {
	if e == nil {
		return nil
	}
	var out []Rule
	for _, l := range e.Global {
		out = append(out, makeRule(l, endpointGlobals, ScopeGlobal, endpoint, p.Shadow))
	}
	return slices.Clip(out)
}

func (p *Policy) tenantRules(t *Tenant) []Rule {
	if t == nil {
		return nil
	}
	var out []Rule
	shadow := p.Shadow || t.Shadow
	for _, l := range t.Quotas {
		out = append(out, makeRule(l, tenantQuotas, ScopeTenant, "", shadow))
	}
	for _, l := range t.Rates {
		out = append(out, makeRule(l, tenantRates, ScopeTenant, "", shadow))
	}
	return slices.Clip(out)
}

// subjectRules assembles a Subject list: the tenant's rules, the plan's
// quotas and rates, and the per-user limits of endpoint (e may be nil).
func (p *Policy) subjectRules(tenant []Rule, pl *Plan, endpoint string, e *Endpoint) []Rule {
	n := len(tenant)
	if pl != nil {
		n += len(pl.Quotas) + len(pl.Rates)
	}
	if e != nil {
		n += len(e.User)
	}
	if n == 0 {
		return nil
	}
	out := make([]Rule, 0, n)
	out = append(out, tenant...)
	if pl != nil {
		shadow := p.Shadow || pl.Shadow
		for _, l := range pl.Quotas {
			out = append(out, makeRule(l, planQuotas, ScopeUser, "", shadow))
		}
		for _, l := range pl.Rates {
			out = append(out, makeRule(l, planRates, ScopeUser, "", shadow))
		}
	}
	if e != nil {
		for _, l := range e.User {
			out = append(out, makeRule(l, endpointUsers, ScopeUser, endpoint, p.Shadow))
		}
	}
	return out
}

// normalize fills in the defaults of a validated policy, so that what it
// holds is what Resolve returns: null entries become empty ones, every limit
// gets its unit and every rolling limit its bucket count.
func (p *Policy) normalize() {
	fill := func(list []Limit, ll limitList) {
		for i := range list {
			l := &list[i]
			l.Unit = effectiveUnit(l, ll.defaultUnit)
			if l.Kind == Rolling && l.Buckets == 0 {
				l.Buckets = DefaultBuckets
			}
		}
	}
	for name, pl := range p.Plans {
		if pl == nil {
			pl = &Plan{}
			p.Plans[name] = pl
		}
		fill(pl.Quotas, planQuotas)
		fill(pl.Rates, planRates)
	}
	for name, t := range p.Tenants {
		if t == nil {
			t = &Tenant{}
			p.Tenants[name] = t
		}
		fill(t.Quotas, tenantQuotas)
		fill(t.Rates, tenantRates)
	}
	for name, e := range p.Endpoints {
		if e == nil {
			e = &Endpoint{}
			p.Endpoints[name] = e
		}
		fill(e.Global, endpointGlobals)
		fill(e.User, endpointUsers)
	}
	fill(p.IP, ipLimits)
}

// buildIndex precomputes Resolve's answers for a validated, normalized
// policy.
func buildIndex(p *Policy, digest string) *policyIndex {
	ix := &policyIndex{
		digest:    digest,
		ip:        p.ipRules(),
		tenants:   make(map[string]tenantEntry, len(p.Tenants)),
		endpoints: make(map[string]endpointEntry, len(p.Endpoints)),
		subjects:  map[subjectKey][]Rule{},
		longest:   p.longestTokenWindow(),
		counted:   p.planWindowsCounted(),
	}
	userEndpoints := []string{""}
	for _, name := range slices.Sorted(maps.Keys(p.Endpoints)) {
		e := p.Endpoints[name]
		ix.endpoints[name] = endpointEntry{global: p.globalRules(name, e), hasUser: len(e.User) > 0}
		if len(e.User) > 0 {
			userEndpoints = append(userEndpoints, name)
		}
	}
	var ruled []string // tenants with tenant-wide limits
	for _, name := range slices.Sorted(maps.Keys(p.Tenants)) {
		t := p.Tenants[name]
		rules := p.tenantRules(t)
		if t.Plan != "" || len(t.Plans) > 0 || len(rules) > 0 {
			ix.tenants[name] = tenantEntry{plan: t.Plan, plans: slices.Clip(t.Plans), rules: rules,
				counted: ix.counted && requestWindows(rules)}
		}
		if len(rules) > 0 {
			ruled = append(ruled, name)
		}
	}

	plans := slices.Sorted(maps.Keys(p.Plans))
	budget := maxPrecomputed
	add := func(tenant, plan string) {
		te := ix.tenants[tenant]
		pl := p.Plans[plan]
		for _, ep := range userEndpoints {
			k := subjectKey{tenant: tenant, plan: plan, endpoint: ep}
			e := p.Endpoints[ep]
			n := 1 + len(te.rules) + len(pl.Quotas) + len(pl.Rates) // 1: the map entry itself
			if e != nil {
				n += len(e.User)
			}
			if _, done := ix.subjects[k]; done || n > budget {
				continue
			}
			budget -= n
			ix.subjects[k] = p.subjectRules(te.rules, pl, ep, e)
		}
	}
	for _, plan := range plans {
		add("", plan)
	}
	for _, t := range ruled {
		own := ix.tenants[t].plan
		if own == "" {
			own = p.DefaultPlan
		}
		add(t, own)
	}
	for _, t := range ruled {
		for _, plan := range plans {
			add(t, plan)
		}
	}
	return ix
}

// calendarMonthSpan is the longest calendar month.
const calendarMonthSpan = 31 * 24 * time.Hour

// LongestTokenWindow is the longest span of time any token limit of the
// policy looks back over: the window of rolling and fixed limits, 31 days for
// calendar_month, and for a token bucket the time it takes to refill from
// empty (per when rate is 0, capped at 400 days). Balances have no window
// and count nothing here. The accounter rebuilds and corrects usage this far
// back; it is 0 when the policy has no token limits.
func (p *Policy) LongestTokenWindow() time.Duration {
	if p.idx != nil {
		return p.idx.longest
	}
	return p.longestTokenWindow()
}

func (p *Policy) longestTokenWindow() time.Duration {
	var longest time.Duration
	scan := func(list []Limit, ll limitList) {
		for i := range list {
			if effectiveUnit(&list[i], ll.defaultUnit) == Tokens {
				longest = max(longest, tokenSpan(&list[i]))
			}
		}
	}
	for _, pl := range p.Plans {
		if pl != nil {
			scan(pl.Quotas, planQuotas)
			scan(pl.Rates, planRates)
		}
	}
	for _, t := range p.Tenants {
		if t != nil {
			scan(t.Quotas, tenantQuotas)
			scan(t.Rates, tenantRates)
		}
	}
	for _, e := range p.Endpoints {
		if e != nil {
			scan(e.Global, endpointGlobals)
			scan(e.User, endpointUsers)
		}
	}
	scan(p.IP, ipLimits)
	return longest
}

// tokenSpan is how far back a limit's state depends on usage.
func tokenSpan(l *Limit) time.Duration {
	switch l.Kind {
	case Rolling, Fixed, SlidingLog:
		return time.Duration(l.Window)
	case CalendarMonth:
		return calendarMonthSpan
	case TokenBucket:
		if l.Rate <= 0 {
			return time.Duration(l.Per)
		}
		refill := float64(l.Burst) / l.Rate * float64(l.Per)
		if refill >= float64(maxWindow) || math.IsNaN(refill) {
			return maxWindow
		}
		return time.Duration(math.Ceil(refill))
	}
	return 0
}

// Cost turns a request's input and output tokens into weighted tokens with
// the model's weights (1 and 1 for a model the policy does not list):
// input×InputWeight + output×OutputWeight, rounded up to a whole token.
// Negative counts count as 0, a product within 1e-9 of a whole number is
// that number (so 30 tokens at weight 0.1 cost 3, not 4) and the result
// saturates at math.MaxInt64.
func (p *Policy) Cost(model string, input, output int64) int64 {
	input, output = max(input, 0), max(output, 0)
	w, ok := p.Models[model]
	if !ok {
		if input > math.MaxInt64-output {
			return math.MaxInt64
		}
		return input + output
	}
	v := float64(input)*w.InputWeight + float64(output)*w.OutputWeight
	switch {
	case !(v > 0): // also NaN, from weights a validated policy cannot hold
		return 0
	case v >= math.MaxInt64: // float64(MaxInt64) is 2^63
		return math.MaxInt64
	}
	if r := math.Round(v); math.Abs(v-r) <= 1e-9*max(1, r) {
		return int64(r)
	}
	return int64(math.Ceil(v))
}
