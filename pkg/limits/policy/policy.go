package policy

import (
	"reflect"
	"time"
)

// Kind names a limiting algorithm. See the package documentation for what
// each one guarantees, its error bound and its memory per key.
type Kind string

// The algorithms a Limit can use.
const (
	Rolling       Kind = "rolling"        // sliding window kept as time buckets, exact to one bucket
	Fixed         Kind = "fixed"          // resets every window, aligned to the Unix epoch
	CalendarMonth Kind = "calendar_month" // resets at the start of each UTC month
	TokenBucket   Kind = "token_bucket"   // refills at rate/per up to burst; rate 0 = fixed allowance per `per`
	SlidingLog    Kind = "sliding_log"    // exact log of request times, for small request counts
	Balance       Kind = "balance"        // prepaid credits that only top-ups raise
	Concurrency   Kind = "concurrency"    // requests in flight; a slot is held until settled or expired
)

// Unit is what a limit counts.
type Unit string

// The units a limit counts. A request costs 1 in a Requests limit and its
// weighted token cost in a Tokens limit.
const (
	Tokens   Unit = "tokens"
	Requests Unit = "requests"
)

// Scope says whose counter a limit is. The order of the constants is the
// order in which admission checks the layers.
type Scope string

// The scopes, in checking order.
const (
	ScopeIP     Scope = "ip"     // per client IP address
	ScopeGlobal Scope = "global" // per endpoint, shared by every caller
	ScopeTenant Scope = "tenant" // tenant-wide, shared by the tenant's users
	ScopeUser   Scope = "user"   // per (tenant, user)
)

// Limit is one limit as written in the policy file.
//
// Which fields apply depends on Kind: Limit and Window for rolling, fixed
// and sliding_log; Limit for calendar_month and concurrency; Rate, Per and
// Burst for token_bucket; nothing for balance (its credits come from
// top-ups). Buckets (rolling only) sets how many time buckets keep the
// window; zero means DefaultBuckets.
//
// Validate (run by Parse) states the exact rules per kind and per list; in
// short, every amount is at most 1e12 and every duration a whole number of
// milliseconds of at most 400 days.
type Limit struct {
	// Name identifies the counter within its scope: 1 to 64 of A-Z a-z 0-9
	// _ . -, unique among the limits that share a scope (a plan's quotas
	// and rates together, a tenant's quotas and rates together, one
	// endpoint's global or user list, the ip list).
	Name string `yaml:"name"`
	// Kind is the algorithm (required).
	Kind Kind `yaml:"kind"`
	// Unit is what the limit counts. Parse fills it in: sliding_log and
	// concurrency count requests and balance counts tokens; other kinds
	// count tokens under a list named quotas and requests elsewhere.
	Unit Unit `yaml:"unit,omitempty"`
	// Limit is the capacity, in Unit, per Window (rolling, fixed,
	// sliding_log), per UTC month (calendar_month) or in flight at once
	// (concurrency).
	Limit int64 `yaml:"limit,omitempty"`
	// Window is the length of a rolling, fixed or sliding_log window.
	Window Duration `yaml:"window,omitempty"`
	// Buckets is how many time buckets keep a rolling window (2 to 120;
	// Parse turns 0 into DefaultBuckets). Window must split into that many
	// buckets of a whole number of milliseconds.
	Buckets int `yaml:"buckets,omitempty"`
	// Rate is how many units a token bucket regains every Per. Zero makes
	// it a fixed allowance: Burst units that come back in full Per after
	// the bucket is first used.
	Rate float64 `yaml:"rate,omitempty"`
	// Per is the period of Rate (token_bucket).
	Per Duration `yaml:"per,omitempty"`
	// Burst is a token bucket's capacity, in Unit: what a full bucket admits
	// at once. A token bucket takes no Limit; Burst is its capacity.
	Burst int64 `yaml:"burst,omitempty"`
	// Shadow makes the limit count but never deny. Resolve also sets it on
	// the Rule when the limit's plan or tenant entry, or the whole policy,
	// is shadow.
	Shadow bool `yaml:"shadow,omitempty"`
	// Alerts are the percentages of the limit at which the alerter raises
	// quota.threshold: integers 1 to 100, ascending, no repeats. Left out
	// (nil), the kind's default applies (DefaultAlerts); an empty list
	// means none.
	Alerts []int `yaml:"alerts,omitempty"`
}

// Equal reports whether l and o are the same limit, field by field (Alerts
// makes Limit incomparable with ==).
func (l *Limit) Equal(o *Limit) bool { return reflect.DeepEqual(*l, *o) }

// DefaultBuckets is the number of time buckets of a rolling window when the
// policy does not say. 24 keeps a 5 h window exact to 12.5 minutes and a
// 30 d window to 30 hours, in 156 bytes of Redis value per window.
const DefaultBuckets = 24

// Plan is a tier: the token quotas and request rates every user on it gets,
// each counted per (tenant, user). Quotas default to unit tokens, Rates to
// requests; the two lists share one namespace of limit names. Shadow makes
// every limit of the plan shadow.
type Plan struct {
	Quotas []Limit `yaml:"quotas,omitempty"`
	Rates  []Limit `yaml:"rates,omitempty"`
	Shadow bool    `yaml:"shadow,omitempty"`
}

// Tenant holds a tenant's default plan and its tenant-wide limits, which all
// of the tenant's users share. Plan, when set, names a plan of the policy and
// replaces default_plan for requests that name no plan. Plans lists the other
// plans a caller whose API token is bound to this tenant may name (see
// Policy.Grants); the tenant's own plan is always granted. Shadow makes the
// tenant-wide limits shadow (not the plan's).
type Tenant struct {
	Plan   string   `yaml:"plan,omitempty"`
	Plans  []string `yaml:"plans,omitempty"`
	Quotas []Limit  `yaml:"quotas,omitempty"`
	Rates  []Limit  `yaml:"rates,omitempty"`
	Shadow bool     `yaml:"shadow,omitempty"`
}

// Endpoint holds the limits of one API path: Global ones shared by all
// callers, User ones applied to each (tenant, user) separately. Both default
// to unit requests. Global limits take the kinds rolling, fixed,
// token_bucket and sliding_log; User limits any kind but balance.
type Endpoint struct {
	Global []Limit `yaml:"global,omitempty"`
	User   []Limit `yaml:"user,omitempty"`
}

// ModelWeights turns a model's input and output tokens into weighted tokens:
// cost = input×InputWeight + output×OutputWeight, rounded up (Policy.Cost).
// Weights are finite and non-negative, and at least one is positive. In YAML
// a weight left out is 1, so {output_weight: 3} means input 1, output 3.
type ModelWeights struct {
	InputWeight  float64 `yaml:"input_weight"`
	OutputWeight float64 `yaml:"output_weight"`
}

// Policy is the whole policy file. Load it with Parse or LoadFile, which
// validate it, fill in defaults (units, rolling buckets) and precompute what
// Resolve needs; a Watcher keeps the current one of a file that may change.
// A Policy is read-only once loaded and safe to share between goroutines.
//
// A Policy built in Go code works too (check it with Validate), but Resolve
// then assembles the rules on every call instead of looking them up.
type Policy struct {
	// DefaultPlan is the plan of a request that names none and whose
	// tenant has none. It must name one of Plans.
	DefaultPlan string `yaml:"default_plan"`
	// Plans maps a plan name (1 to 64 of A-Z a-z 0-9 _ . -) to the plan.
	// At least one is required.
	Plans map[string]*Plan `yaml:"plans"`
	// Tenants maps a tenant id, as requests send it, to its plan and
	// tenant-wide limits. A tenant not listed has default_plan and no
	// tenant-wide limits.
	Tenants map[string]*Tenant `yaml:"tenants,omitempty"`
	// Endpoints maps an API path, matched exactly against the request's
	// endpoint (no prefixes, no patterns), to its limits. An undeclared
	// endpoint has none.
	Endpoints map[string]*Endpoint `yaml:"endpoints,omitempty"`
	// IP holds the limits counted per client IP address, checked first.
	IP []Limit `yaml:"ip,omitempty"`
	// Models maps a model name to the weights of its tokens; see Cost.
	Models map[string]ModelWeights `yaml:"models,omitempty"`
	// Shadow makes every limit of the policy shadow: counted, reported,
	// never denying. Use it to roll out a new policy.
	Shadow bool `yaml:"shadow,omitempty"`

	idx *policyIndex // built by Parse; nil for a Policy built in code
}

// Duration is a time.Duration written in YAML as a Go duration string
// ("5h", "168h", "1s").
type Duration time.Duration
