package policy

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"

	"quotaflow/pkg/ident"
)

// Error is one problem in a policy: where (Path, e.g.
// "plans.free.quotas[1].window", or "endpoints[\"/v1/x\"].user[0].limit"
// for a key that is not a plain word) and what is wrong. Parse and Validate
// return every problem at once, joined with errors.Join; errors.As finds the
// first.
type Error struct {
	Path    string
	Problem string
}

// Error returns "path: problem".
func (e *Error) Error() string {
	if e.Path == "" {
		return "policy " + e.Problem
	}
	return e.Path + ": " + e.Problem
}

// The bounds Validate enforces on every limit.
const (
	// maxAmount bounds limit, burst and rate: the engine packs counters
	// as 48-bit signed integers (±1.4e14), and 1e12 leaves room for costs
	// and corrections above a full counter.
	maxAmount = 1_000_000_000_000
	// maxWindow bounds windows and token bucket periods: a year-long
	// quota fits, and Redis TTLs and millisecond arithmetic stay small.
	maxWindow = 400 * 24 * time.Hour
	// maxLogEntries bounds a sliding_log: it stores one entry per request.
	maxLogEntries = 1000
	// minBuckets and maxBuckets bound a rolling window's buckets: one
	// bucket is a fixed window, and a rolling window is read whole on
	// every request.
	minBuckets = 2
	maxBuckets = 120
	maxNameLen = 64
	// maxListLen bounds one list of limits. Every rule of a request is a
	// key of one script call; no tier needs more, and YAML aliases cannot
	// then blow a small file up into a huge policy.
	maxListLen = 100
)

// allKinds lists the kinds in the order the error messages name them.
var allKinds = []Kind{Rolling, Fixed, CalendarMonth, TokenBucket, SlidingLog, Balance, Concurrency}

// limitList describes one list of limits in the file: which scope its
// counters live in, its default unit and the kinds it may hold.
type limitList struct {
	what        string // for messages: "ip limits"
	defaultUnit Unit
	kinds       []Kind // nil: every kind
	noAlerts    bool   // shared counters: the alerter raises no thresholds of them
}

// The lists of a policy. IP and endpoint global limits guard capacity over
// short horizons and are shared by everyone: monthly budgets belong to plans
// and tenants, a balance is credited per (tenant, user), and a concurrency
// slot is released by (tenant, user, request_id) on the tenant's keys, which
// cannot also update a counter outside the tenant's hash tag atomically. A
// tenant-wide balance could not be topped up (top-ups credit a user).
var (
	edgeKinds       = []Kind{Rolling, Fixed, TokenBucket, SlidingLog}
	allButBalance   = []Kind{Rolling, Fixed, CalendarMonth, TokenBucket, SlidingLog, Concurrency}
	planQuotas      = limitList{what: "plan quotas", defaultUnit: Tokens}
	planRates       = limitList{what: "plan rates", defaultUnit: Requests}
	tenantQuotas    = limitList{what: "tenant quotas", defaultUnit: Tokens, kinds: allButBalance}
	tenantRates     = limitList{what: "tenant rates", defaultUnit: Requests, kinds: allButBalance}
	endpointGlobals = limitList{what: "endpoint global limits", defaultUnit: Requests, kinds: edgeKinds, noAlerts: true}
	endpointUsers   = limitList{what: "endpoint user limits", defaultUnit: Requests, kinds: allButBalance}
	ipLimits        = limitList{what: "ip limits", defaultUnit: Requests, kinds: edgeKinds, noAlerts: true}
)

// Validate checks a policy and returns every problem it finds, as
// *Error values joined with errors.Join, in a stable order: the
// sections in file order (default_plan, plans, tenants, endpoints, ip,
// models), map keys sorted, and within a limit name, kind, unit, then the
// kind's fields. Parse runs it; call it yourself on a Policy built in code.
//
// The rules, per limit (Limit describes the fields):
//   - name: 1 to 64 of A-Z a-z 0-9 _ . -, unique in its scope: a plan's
//     quotas and rates together, a tenant's quotas and rates together,
//     one endpoint's global list, its user list, the ip list.
//   - unit: tokens or requests; sliding_log and concurrency count requests
//     and balance counts tokens.
//   - rolling: 0 < limit; 0 < window ≤ 400 days; buckets 0 (DefaultBuckets)
//     or 2 to 120, and the window splits into that many buckets of a whole
//     number of milliseconds.
//   - fixed: 0 < limit; window > 0, a whole number of milliseconds.
//   - calendar_month: 0 < limit.
//   - token_bucket: burst > 0, rate ≥ 0 (finite), per > 0; no limit, since
//     burst is the capacity.
//   - sliding_log: 1 ≤ limit ≤ 1000; window > 0.
//   - balance: nothing (credits come from top-ups); only in plans.
//   - concurrency: 0 < limit; not in the ip or endpoint global lists.
//   - ip and endpoint global lists take rolling, fixed, token_bucket and
//     sliding_log; tenant and endpoint user lists any kind but balance.
//   - every amount (limit, burst, rate) is at most 1e12, every duration a
//     whole number of milliseconds of at most 400 days, and fields the kind
//     does not use are left out.
//   - alerts, when set, are integers 1 to 100, ascending, each once, and
//     only on user- and tenant-scope limits (not ip or endpoint global).
//   - a list holds at most 100 limits.
//
// And for the policy: plans non-empty, with names like limit names; a limit
// name used in several plans has the same kind and unit in each (and, if
// rolling, the same bucket length), since a user's counter is keyed by name
// and outlives a plan change;
// default_plan, every tenant's plan and every plan a tenant's plans list
// names defined; tenant, endpoint and model names valid identifiers
// (package ident: 1 to 256 bytes of UTF-8 without control characters);
// endpoints paths starting with "/" without white space; model weights
// finite, non-negative and not both zero.
func (p *Policy) Validate() error {
	if p == nil {
		return errors.New("policy is nil")
	}
	var c policyChecker
	c.policy(p)
	return errors.Join(c.errs...)
}

// policyChecker collects the problems of one policy.
type policyChecker struct {
	errs []error
}

func (c *policyChecker) add(path, format string, args ...any) {
	c.errs = append(c.errs, &Error{Path: path, Problem: fmt.Sprintf(format, args...)})
}

func (c *policyChecker) policy(p *Policy) {
	switch _, ok := p.Plans[p.DefaultPlan]; {
	case p.DefaultPlan == "":
		c.add("default_plan", "required")
	case !ok:
		c.add("default_plan", "plan %q is not defined", p.DefaultPlan)
	}

	if len(p.Plans) == 0 {
		c.add("plans", "at least one plan is required")
	}
	shapes := map[string]counterShape{} // limit name → first shape in any plan
	for _, name := range slices.Sorted(maps.Keys(p.Plans)) {
		path := keyPath("plans", name)
		if !validName(name) {
			c.add(path, "invalid plan name: use 1 to 64 letters, digits, '_', '.' or '-'")
		}
		pl := p.Plans[name]
		if pl == nil {
			continue
		}
		seen := map[string]string{}
		c.limits(keyPath(path, "quotas"), pl.Quotas, planQuotas, seen)
		c.limits(keyPath(path, "rates"), pl.Rates, planRates, seen)
		c.sameShape(shapes, path, keyPath(path, "quotas"), pl.Quotas, planQuotas)
		c.sameShape(shapes, path, keyPath(path, "rates"), pl.Rates, planRates)
	}

	for _, name := range slices.Sorted(maps.Keys(p.Tenants)) {
		path := keyPath("tenants", name)
		c.identifier(path, "tenant", name)
		t := p.Tenants[name]
		if t == nil {
			continue
		}
		if _, ok := p.Plans[t.Plan]; t.Plan != "" && !ok {
			c.add(keyPath(path, "plan"), "plan %q is not defined", t.Plan)
		}
		for i, name := range t.Plans {
			if _, ok := p.Plans[name]; !ok {
				c.add(indexPath(keyPath(path, "plans"), i), "plan %q is not defined", name)
			}
		}
		seen := map[string]string{}
		c.limits(keyPath(path, "quotas"), t.Quotas, tenantQuotas, seen)
		c.limits(keyPath(path, "rates"), t.Rates, tenantRates, seen)
	}

	for _, name := range slices.Sorted(maps.Keys(p.Endpoints)) {
		path := keyPath("endpoints", name)
		if !strings.HasPrefix(name, "/") {
			c.add(path, "endpoint must be a path starting with \"/\"")
		} else {
			c.identifier(path, "endpoint", name)
		}
		e := p.Endpoints[name]
		if e == nil {
			continue
		}
		c.limits(keyPath(path, "global"), e.Global, endpointGlobals, map[string]string{})
		c.limits(keyPath(path, "user"), e.User, endpointUsers, map[string]string{})
	}

	c.limits("ip", p.IP, ipLimits, map[string]string{})

	for _, name := range slices.Sorted(maps.Keys(p.Models)) {
		path := keyPath("models", name)
		c.identifier(path, "model", name)
		m := p.Models[name]
		c.weight(keyPath(path, "input_weight"), m.InputWeight)
		c.weight(keyPath(path, "output_weight"), m.OutputWeight)
		if m.InputWeight == 0 && m.OutputWeight == 0 {
			c.add(path, "at least one weight must be positive")
		}
	}
}

// counterShape is what must agree between plans that use one limit name.
type counterShape struct {
	plan     string // where it was first seen
	kind     Kind
	unit     Unit
	bucketMs int64 // rolling only
}

// sameShape checks that a limit name means the same kind of counter in
// every plan. A user's counter is keyed by the limit's name, not its plan,
// so that it survives a plan change (an upgrade does not reset usage); the
// engine then reads the state another plan wrote, which only works if both
// plans store it the same way.
func (c *policyChecker) sameShape(shapes map[string]counterShape, plan, path string, list []Limit, ll limitList) {
	for i := range list {
		l := &list[i]
		if _, known := fieldsOf[l.Kind]; !known || !validName(l.Name) {
			continue
		}
		sh := counterShape{plan: plan, kind: l.Kind, unit: effectiveUnit(l, ll.defaultUnit)}
		if l.Kind == Rolling {
			if n := l.Buckets; n == 0 {
				sh.bucketMs = time.Duration(l.Window).Milliseconds() / DefaultBuckets
			} else if n > 0 {
				sh.bucketMs = time.Duration(l.Window).Milliseconds() / int64(n)
			}
		}
		first, ok := shapes[l.Name]
		switch {
		case !ok:
			shapes[l.Name] = sh
		case first.plan == plan:
			// a duplicate within the plan, reported by limits
		case first.kind != sh.kind || first.unit != sh.unit:
			c.add(indexPath(path, i), "%q is %s counting %s in %s: a limit name keeps its kind and unit in every plan (a user's counter outlives a plan change)",
				l.Name, first.kind, first.unit, first.plan)
		case first.bucketMs != sh.bucketMs:
			c.add(indexPath(path, i), "%q has %d ms buckets in %s: a rolling limit name keeps its bucket length (window / buckets) in every plan (a user's counter outlives a plan change)",
				l.Name, first.bucketMs, first.plan)
		}
	}
}

// identifier checks a tenant, endpoint or model name.
// identifier checks a tenant, endpoint or model name by the rule the
// admission API applies to the requests that name it (package ident): a
// policy entry no request could match is a mistake. Endpoints are paths,
// which never hold white space either.
func (c *policyChecker) identifier(path, what, name string) {
	if name == "" {
		c.add(path, "%s name must not be empty", what)
	} else if err := ident.Check(name); err != nil {
		c.add(path, "%s name %v", what, err)
	} else if what == "endpoint" && strings.ContainsFunc(name, unicode.IsSpace) {
		c.add(path, "endpoint name contains a space character")
	}
}

func (c *policyChecker) weight(path string, w float64) {
	switch {
	case math.IsNaN(w) || math.IsInf(w, 0):
		c.add(path, "must be a finite number")
	case w < 0:
		c.add(path, "must not be negative")
	}
}

// limits checks one list. seen maps the names already used in the list's
// scope to where, so that a plan's rates and quotas share one namespace.
func (c *policyChecker) limits(path string, list []Limit, ll limitList, seen map[string]string) {
	if len(list) > maxListLen {
		c.add(path, "holds %d limits, more than %d", len(list), maxListLen)
		return
	}
	for i, l := range list {
		lp := indexPath(path, i)
		np := lp + ".name"
		switch {
		case l.Name == "":
			c.add(np, "required")
		case !validName(l.Name):
			c.add(np, "invalid name %q: use 1 to 64 letters, digits, '_', '.' or '-'", l.Name)
		default:
			if _, dup := seen[l.Name]; dup {
				c.add(np, "duplicate name %q", l.Name)
			} else {
				seen[l.Name] = np
			}
		}
		c.limit(lp, l, ll)
	}
}

// kindFields says which numeric fields a kind reads.
type kindFields struct{ limit, window, buckets, rate, per, burst bool }

var fieldsOf = map[Kind]kindFields{
	Rolling:       {limit: true, window: true, buckets: true},
	Fixed:         {limit: true, window: true},
	CalendarMonth: {limit: true},
	TokenBucket:   {rate: true, per: true, burst: true},
	SlidingLog:    {limit: true, window: true},
	Balance:       {},
	Concurrency:   {limit: true},
}

// unitOf is the unit a kind must count, or "" when it can count either.
func unitOf(k Kind) Unit {
	switch k {
	case SlidingLog, Concurrency:
		return Requests
	case Balance:
		return Tokens
	}
	return ""
}

// effectiveUnit is the unit a limit counts once defaults apply.
func effectiveUnit(l *Limit, listDefault Unit) Unit {
	switch {
	case l.Unit != "":
		return l.Unit
	case unitOf(l.Kind) != "":
		return unitOf(l.Kind)
	}
	return listDefault
}

func (c *policyChecker) limit(path string, l Limit, ll limitList) {
	kp := path + ".kind"
	f, known := fieldsOf[l.Kind]
	switch {
	case l.Kind == "":
		c.add(kp, "required")
	case !known:
		c.add(kp, "unknown kind %q (want %s)", l.Kind, kindList(allKinds))
	case ll.kinds != nil && !slices.Contains(ll.kinds, l.Kind):
		c.add(kp, "%s is not allowed in %s (allowed: %s)", l.Kind, ll.what, kindList(ll.kinds))
	}

	if l.Unit != "" && l.Unit != Tokens && l.Unit != Requests {
		c.add(path+".unit", "unknown unit %q (want tokens or requests)", l.Unit)
	} else if u := unitOf(l.Kind); u != "" && l.Unit != "" && l.Unit != u {
		c.add(path+".unit", "kind %s counts %s", l.Kind, u)
	}
	if ll.noAlerts && l.Alerts != nil {
		c.add(path+".alerts", "not used in %s: only user- and tenant-scope limits alert", ll.what)
	} else {
		c.alerts(path+".alerts", l.Alerts)
	}
	if !known {
		return // its fields mean nothing yet
	}

	hint := ""
	switch l.Kind {
	case TokenBucket:
		hint = " (burst is its capacity)"
	case CalendarMonth:
		hint = " (it resets at the start of each UTC month)"
	case Balance:
		hint = " (credits come from top-ups)"
	}
	unused := func(field string, set bool) {
		if set {
			c.add(path+"."+field, "not used by kind %s%s", l.Kind, hint)
		}
	}

	if f.limit {
		lp := path + ".limit"
		switch {
		case l.Limit <= 0:
			c.add(lp, "must be positive")
		case l.Kind == SlidingLog && l.Limit > maxLogEntries:
			c.add(lp, "must be at most %d for kind sliding_log (it stores one entry per request)", maxLogEntries)
		case l.Limit > maxAmount:
			c.add(lp, "must be at most %d", int64(maxAmount))
		}
	} else {
		unused("limit", l.Limit != 0)
	}

	windowOK := false
	if f.window {
		windowOK = c.duration(path+".window", l.Window)
	} else {
		unused("window", l.Window != 0)
	}

	if f.buckets {
		n := l.Buckets
		if n == 0 {
			n = DefaultBuckets
		}
		switch ms := time.Duration(l.Window).Milliseconds(); {
		case l.Buckets != 0 && (l.Buckets < minBuckets || l.Buckets > maxBuckets):
			c.add(path+".buckets", "must be between %d and %d", minBuckets, maxBuckets)
		case windowOK && ms%int64(n) != 0:
			c.add(path+".window", "%s does not split into %d buckets of whole milliseconds (%s)",
				l.Window, n, bucketHint(ms, n))
		}
	} else {
		unused("buckets", l.Buckets != 0)
	}

	if f.rate {
		rp := path + ".rate"
		switch {
		case math.IsNaN(l.Rate) || math.IsInf(l.Rate, 0):
			c.add(rp, "must be a finite number")
		case l.Rate < 0:
			c.add(rp, "must not be negative")
		case l.Rate > maxAmount:
			c.add(rp, "must be at most %d", int64(maxAmount))
		}
	} else {
		unused("rate", l.Rate != 0)
	}

	if f.per {
		c.duration(path+".per", l.Per)
	} else {
		unused("per", l.Per != 0)
	}

	if f.burst {
		bp := path + ".burst"
		switch {
		case l.Burst <= 0:
			c.add(bp, "must be positive")
		case l.Burst > maxAmount:
			c.add(bp, "must be at most %d", int64(maxAmount))
		}
	} else {
		unused("burst", l.Burst != 0)
	}
}

// duration checks a window or period and reports whether it is usable.
func (c *policyChecker) duration(path string, d Duration) bool {
	switch v := time.Duration(d); {
	case v <= 0:
		c.add(path, "must be positive")
	case v%time.Millisecond != 0:
		c.add(path, "must be a whole number of milliseconds")
	case v > maxWindow:
		c.add(path, "must be at most %s (400 days)", fmtHours(maxWindow))
	default:
		return true
	}
	return false
}

// bucketHint suggests a bucket count that splits a window of ms
// milliseconds, the one closest to n.
func bucketHint(ms int64, n int) string {
	best := 0
	for b := minBuckets; b <= maxBuckets; b++ {
		if ms%int64(b) == 0 && (best == 0 || absInt(b-n) < absInt(best-n)) {
			best = b
		}
	}
	if best == 0 {
		return fmt.Sprintf("no count from %d to %d does; pick another window", minBuckets, maxBuckets)
	}
	return "try buckets: " + strconv.Itoa(best)
}

func absInt(x int) int { return max(x, -x) }

// fmtHours writes a whole number of hours as "9600h".
func fmtHours(d time.Duration) string { return strconv.FormatInt(int64(d/time.Hour), 10) + "h" }

func kindList(ks []Kind) string {
	s := make([]string, len(ks))
	for i, k := range ks {
		s[i] = string(k)
	}
	return strings.Join(s, ", ")
}

// validName reports whether s is a valid limit or plan name: 1 to 64 of
// A-Z a-z 0-9 _ . -.
func validName(s string) bool {
	if s == "" || len(s) > maxNameLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		if !nameByte(s[i]) && s[i] != '.' {
			return false
		}
	}
	return true
}

// nameByte reports whether b may appear in a key written bare in a path.
func nameByte(b byte) bool {
	return 'a' <= b && b <= 'z' || 'A' <= b && b <= 'Z' || '0' <= b && b <= '9' || b == '_' || b == '-'
}

// keyPath appends a map key or field name to a path: plans.free, or
// endpoints["/api/v1/generate"] when the key is not a plain word.
func keyPath(path, key string) string {
	plain := key != ""
	for i := 0; i < len(key) && plain; i++ {
		plain = nameByte(key[i])
	}
	switch {
	case !plain:
		return path + "[" + strconv.Quote(key) + "]"
	case path == "":
		return key
	}
	return path + "." + key
}

// indexPath appends a list index to a path: plans.free.quotas[1].
func indexPath(path string, i int) string { return path + "[" + strconv.Itoa(i) + "]" }
