package policy

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// planWith is a policy whose one plan, free, has the given quotas.
func planWith(quotas string) string {
	return "default_plan: free\nplans: {free: {quotas: [" + quotas + "]}}\n"
}

// withList is a valid policy plus one more top-level section.
func withList(section string) string {
	return "default_plan: free\nplans: {free: {}}\n" + section + "\n"
}

func TestParseValidationErrors(t *testing.T) {
	const ok5h = "{name: 5h, kind: rolling, window: 5h, limit: 1000}"
	tests := []struct {
		name, src, want string
	}{
		// The policy as a whole.
		{"no default plan", "plans: {free: {}}", "default_plan: required"},
		{"undefined default plan", "default_plan: x\nplans: {free: {}}", `default_plan: plan "x" is not defined`},
		{"no plans", "default_plan: free", "default_plan: plan \"free\" is not defined\nplans: at least one plan is required"},
		{"bad plan name", "default_plan: free\nplans: {free: {}, gold plan: {}}", `plans["gold plan"]: invalid plan name: use 1 to 64 letters, digits, '_', '.' or '-'`},
		{"tenant plan undefined", withList("tenants: {acme: {plan: gold}}"), `tenants.acme.plan: plan "gold" is not defined`},
		{"tenant empty name", withList(`tenants: {"": {plan: free}}`), `tenants[""]: tenant name must not be empty`},
		{"tenant long name", withList("tenants: {" + strings.Repeat("t", 257) + ": {}}"), "tenants." + strings.Repeat("t", 257) + ": tenant name longer than 256 bytes"},
		{"tenant name with NUL", withList(`tenants: {"a\0b": {}}`), `tenants["a\x00b"]: tenant name contains a control character`},
		{"tenant name with C1", withList(`tenants: {"a\x85": {}}`), `tenants["a\u0085"]: tenant name contains a control character`},
		{"tenant name with DEL", withList(`tenants: {"a\x7f": {}}`), `tenants["a\x7f"]: tenant name contains a control character`},
		{"endpoint with NUL", withList(`endpoints: {"/a\0": {}}`), `endpoints["/a\x00"]: endpoint name contains a control character`},
		{"model with tab", withList(`models: {"m\tx": {input_weight: 1}}`), `models["m\tx"]: model name contains a control character`},
		{"tenant grants an undefined plan", withList("tenants: {acme: {plans: [free, gold]}}"), `tenants.acme.plans[1]: plan "gold" is not defined`},
		{"tenant grants an empty plan", withList(`tenants: {acme: {plan: free, plans: [""]}}`), `tenants.acme.plans[0]: plan "" is not defined`},
		{"endpoint not a path", withList("endpoints: {api: {}}"), `endpoints.api: endpoint must be a path starting with "/"`},
		{"endpoint with space", withList(`endpoints: {"/a b": {}}`), `endpoints["/a b"]: endpoint name contains a space character`},

		// Names.
		{"missing name", planWith("{kind: rolling, window: 5h, limit: 1}"), "plans.free.quotas[0].name: required"},
		{"bad name", planWith("{name: 'a b', kind: rolling, window: 5h, limit: 1}"), `plans.free.quotas[0].name: invalid name "a b": use 1 to 64 letters, digits, '_', '.' or '-'`},
		{"long name", planWith("{name: " + strings.Repeat("n", 65) + ", kind: rolling, window: 5h, limit: 1}"), `plans.free.quotas[0].name: invalid name "` + strings.Repeat("n", 65) + `": use 1 to 64 letters, digits, '_', '.' or '-'`},
		{"duplicate in quotas", planWith(ok5h + ", {name: 7d, kind: rolling, window: 168h, limit: 1}, " + ok5h), `plans.free.quotas[2].name: duplicate name "5h"`},
		{"duplicate across quotas and rates", "default_plan: free\nplans: {free: {quotas: [" + ok5h + "], rates: [{name: 5h, kind: fixed, window: 1s, limit: 1}]}}",
			`plans.free.rates[0].name: duplicate name "5h"`},
		{"duplicate in tenant", withList("tenants: {acme: {quotas: [{name: m, kind: calendar_month, limit: 1}], rates: [{name: m, kind: fixed, window: 1s, limit: 1}]}}"),
			`tenants.acme.rates[0].name: duplicate name "m"`},
		{"duplicate in ip", withList("ip: [{name: b, kind: fixed, window: 1s, limit: 1}, {name: b, kind: fixed, window: 1m, limit: 9}]"), `ip[1].name: duplicate name "b"`},
		{"same name in global and user is fine", withList(`endpoints: {/x: {global: [{name: d, kind: fixed, window: 1s, limit: 1}], user: [{name: d, kind: fixed, window: 1s, limit: 1}]}}`), ""},

		{"list too long", withList("ip: [" + strings.Repeat("{name: b, kind: fixed, window: 1s, limit: 1}, ", 101) + "]"), "ip: holds 101 limits, more than 100"},

		// Kind and unit.
		{"missing kind", planWith("{name: a, limit: 1}"), "plans.free.quotas[0].kind: required"},
		{"unknown kind", planWith("{name: a, kind: leaky, limit: 1}"), `plans.free.quotas[0].kind: unknown kind "leaky" (want rolling, fixed, calendar_month, token_bucket, sliding_log, balance, concurrency)`},
		{"unknown unit", planWith("{name: a, kind: fixed, window: 1s, limit: 1, unit: bytes}"), `plans.free.quotas[0].unit: unknown unit "bytes" (want tokens or requests)`},
		{"sliding log counts requests", planWith("{name: a, kind: sliding_log, window: 1s, limit: 1, unit: tokens}"), "plans.free.quotas[0].unit: kind sliding_log counts requests"},
		{"balance counts tokens", planWith("{name: a, kind: balance, unit: requests}"), "plans.free.quotas[0].unit: kind balance counts tokens"},
		{"concurrency counts requests", planWith("{name: a, kind: concurrency, limit: 1, unit: tokens}"), "plans.free.quotas[0].unit: kind concurrency counts requests"},
		{"balance in ip", withList("ip: [{name: a, kind: balance}]"), "ip[0].kind: balance is not allowed in ip limits (allowed: rolling, fixed, token_bucket, sliding_log)"},
		{"concurrency in global", withList("endpoints: {/x: {global: [{name: a, kind: concurrency, limit: 5}]}}"),
			`endpoints["/x"].global[0].kind: concurrency is not allowed in endpoint global limits (allowed: rolling, fixed, token_bucket, sliding_log)`},
		{"calendar month in global", withList("endpoints: {/x: {global: [{name: a, kind: calendar_month, limit: 5}]}}"),
			`endpoints["/x"].global[0].kind: calendar_month is not allowed in endpoint global limits (allowed: rolling, fixed, token_bucket, sliding_log)`},
		{"balance in endpoint user", withList("endpoints: {/x: {user: [{name: a, kind: balance}]}}"),
			`endpoints["/x"].user[0].kind: balance is not allowed in endpoint user limits (allowed: rolling, fixed, calendar_month, token_bucket, sliding_log, concurrency)`},
		{"balance in tenant", withList("tenants: {acme: {quotas: [{name: a, kind: balance}]}}"),
			"tenants.acme.quotas[0].kind: balance is not allowed in tenant quotas (allowed: rolling, fixed, calendar_month, token_bucket, sliding_log, concurrency)"},

		// rolling
		{"rolling window zero", planWith(ok5h + ", {name: b, kind: rolling, window: 0, limit: 1}"), "plans.free.quotas[1].window: must be positive"},
		{"rolling window missing", planWith("{name: b, kind: rolling, limit: 1}"), "plans.free.quotas[0].window: must be positive"},
		{"rolling window negative", planWith("{name: b, kind: rolling, window: -5h, limit: 1}"), "plans.free.quotas[0].window: must be positive"},
		{"rolling window too long", planWith("{name: b, kind: rolling, window: 9601h, limit: 1}"), "plans.free.quotas[0].window: must be at most 9600h (400 days)"},
		{"rolling limit zero", planWith("{name: b, kind: rolling, window: 5h}"), "plans.free.quotas[0].limit: must be positive"},
		{"rolling limit too big", planWith("{name: b, kind: rolling, window: 5h, limit: 1000000000001}"), "plans.free.quotas[0].limit: must be at most 1000000000000"},
		{"rolling limit at cap", planWith("{name: b, kind: rolling, window: 5h, limit: 1e12}"), ""},
		{"rolling buckets one", planWith("{name: b, kind: rolling, window: 5h, limit: 1, buckets: 1}"), "plans.free.quotas[0].buckets: must be between 2 and 120"},
		{"rolling buckets too many", planWith("{name: b, kind: rolling, window: 5h, limit: 1, buckets: 121}"), "plans.free.quotas[0].buckets: must be between 2 and 120"},
		{"rolling default buckets do not divide", planWith("{name: b, kind: rolling, window: 10s, limit: 1}"), "plans.free.quotas[0].window: 10s does not split into 24 buckets of whole milliseconds (try buckets: 25)"},
		{"rolling buckets do not divide", planWith("{name: b, kind: rolling, window: 1m, limit: 1, buckets: 7}"), "plans.free.quotas[0].window: 1m0s does not split into 7 buckets of whole milliseconds (try buckets: 6)"},
		{"rolling window prime ms", planWith("{name: b, kind: rolling, window: 1ms, limit: 1}"), "plans.free.quotas[0].window: 1ms does not split into 24 buckets of whole milliseconds (no count from 2 to 120 does; pick another window)"},
		{"rolling sub-millisecond", planWith("{name: b, kind: rolling, window: 1500us, limit: 1}"), "plans.free.quotas[0].window: must be a whole number of milliseconds"},
		{"rolling with rate", planWith("{name: b, kind: rolling, window: 5h, limit: 1, rate: 3}"), "plans.free.quotas[0].rate: not used by kind rolling"},

		// fixed
		{"fixed sub-millisecond", planWith("{name: b, kind: fixed, window: 1.5ms, limit: 1}"), "plans.free.quotas[0].window: must be a whole number of milliseconds"},
		{"fixed no window", planWith("{name: b, kind: fixed, limit: 1}"), "plans.free.quotas[0].window: must be positive"},
		{"fixed negative limit", planWith("{name: b, kind: fixed, window: 1s, limit: -1}"), "plans.free.quotas[0].limit: must be positive"},
		{"fixed with buckets", planWith("{name: b, kind: fixed, window: 1s, limit: 1, buckets: 10}"), "plans.free.quotas[0].buckets: not used by kind fixed"},

		// calendar_month
		{"calendar no limit", planWith("{name: m, kind: calendar_month}"), "plans.free.quotas[0].limit: must be positive"},
		{"calendar with window", planWith("{name: m, kind: calendar_month, limit: 1, window: 720h}"), "plans.free.quotas[0].window: not used by kind calendar_month (it resets at the start of each UTC month)"},

		// token_bucket
		{"bucket no burst", planWith("{name: r, kind: token_bucket, rate: 1, per: 1s}"), "plans.free.quotas[0].burst: must be positive"},
		{"bucket no per", planWith("{name: r, kind: token_bucket, rate: 1, burst: 1}"), "plans.free.quotas[0].per: must be positive"},
		{"bucket negative rate", planWith("{name: r, kind: token_bucket, rate: -1, per: 1s, burst: 1}"), "plans.free.quotas[0].rate: must not be negative"},
		{"bucket infinite rate", planWith("{name: r, kind: token_bucket, rate: .inf, per: 1s, burst: 1}"), "plans.free.quotas[0].rate: must be a finite number"},
		{"bucket nan rate", planWith("{name: r, kind: token_bucket, rate: .nan, per: 1s, burst: 1}"), "plans.free.quotas[0].rate: must be a finite number"},
		{"bucket huge rate", planWith("{name: r, kind: token_bucket, rate: 1e13, per: 1s, burst: 1}"), "plans.free.quotas[0].rate: must be at most 1000000000000"},
		{"bucket huge burst", planWith("{name: r, kind: token_bucket, rate: 1, per: 1s, burst: 2e12}"), "plans.free.quotas[0].burst: must be at most 1000000000000"},
		{"bucket with limit", planWith("{name: r, kind: token_bucket, rate: 1, per: 1s, burst: 1, limit: 1}"), "plans.free.quotas[0].limit: not used by kind token_bucket (burst is its capacity)"},
		{"bucket with window", planWith("{name: r, kind: token_bucket, rate: 1, per: 1s, burst: 1, window: 1s}"), "plans.free.quotas[0].window: not used by kind token_bucket (burst is its capacity)"},
		{"bucket per too long", planWith("{name: r, kind: token_bucket, per: 10000h, burst: 1}"), "plans.free.quotas[0].per: must be at most 9600h (400 days)"},
		{"bucket fixed allowance", planWith("{name: r, kind: token_bucket, rate: 0, per: 24h, burst: 15}"), ""},

		// sliding_log
		{"log too long", planWith("{name: s, kind: sliding_log, window: 1m, limit: 1001}"), "plans.free.quotas[0].limit: must be at most 1000 for kind sliding_log (it stores one entry per request)"},
		{"log no window", planWith("{name: s, kind: sliding_log, limit: 10}"), "plans.free.quotas[0].window: must be positive"},

		// balance and concurrency
		{"balance with limit", planWith("{name: c, kind: balance, limit: 100}"), "plans.free.quotas[0].limit: not used by kind balance (credits come from top-ups)"},
		{"concurrency no limit", planWith("{name: c, kind: concurrency}"), "plans.free.quotas[0].limit: must be positive"},
		{"concurrency with window", planWith("{name: c, kind: concurrency, limit: 2, window: 1m}"), "plans.free.quotas[0].window: not used by kind concurrency"},

		// A name keeps its shape across plans.
		{"kind differs across plans", "default_plan: a\nplans: {a: {quotas: [" + ok5h + "]}, b: {quotas: [{name: 5h, kind: fixed, window: 5h, limit: 1}]}}",
			`plans.b.quotas[0]: "5h" is rolling counting tokens in plans.a: a limit name keeps its kind and unit in every plan (a user's counter outlives a plan change)`},
		{"unit differs across plans", "default_plan: a\nplans: {a: {quotas: [{name: d, kind: fixed, window: 1h, limit: 1}]}, b: {rates: [{name: d, kind: fixed, window: 1h, limit: 1}]}}",
			`plans.b.rates[0]: "d" is fixed counting tokens in plans.a: a limit name keeps its kind and unit in every plan (a user's counter outlives a plan change)`},
		{"buckets differ across plans", "default_plan: a\nplans: {a: {quotas: [" + ok5h + "]}, b: {quotas: [{name: 5h, kind: rolling, window: 5h, limit: 9, buckets: 60}]}}",
			`plans.b.quotas[0]: "5h" has 750000 ms buckets in plans.a: a rolling limit name keeps its bucket length (window / buckets) in every plan (a user's counter outlives a plan change)`},

		// Alerts.
		{"alerts out of range", planWith("{name: a, kind: fixed, window: 1h, limit: 1, alerts: [0, 50, 101]}"),
			"plans.free.quotas[0].alerts[0]: 0 is not a percentage from 1 to 100\nplans.free.quotas[0].alerts[2]: 101 is not a percentage from 1 to 100"},
		{"alerts unsorted", planWith("{name: a, kind: fixed, window: 1h, limit: 1, alerts: [90, 80]}"),
			"plans.free.quotas[0].alerts[1]: 80 after 90: list the percentages ascending, each once"},
		{"alerts repeated", withList("tenants: {acme: {rates: [{name: a, kind: fixed, window: 1h, limit: 1, alerts: [50, 50]}]}}"),
			"tenants.acme.rates[0].alerts[1]: 50 after 50: list the percentages ascending, each once"},
		{"alerts on ip", withList("ip: [{name: a, kind: fixed, window: 1s, limit: 1, alerts: []}]"),
			"ip[0].alerts: not used in ip limits: only user- and tenant-scope limits alert"},
		{"alerts on endpoint global", withList("endpoints: {/x: {global: [{name: a, kind: fixed, window: 1s, limit: 1, alerts: [80]}]}}"),
			`endpoints["/x"].global[0].alerts: not used in endpoint global limits: only user- and tenant-scope limits alert`},
		{"alerts on endpoint user", withList("endpoints: {/x: {user: [{name: a, kind: token_bucket, rate: 1, per: 1s, burst: 5, alerts: [1, 100]}]}}"), ""},

		// Models.
		{"negative weight", withList("models: {m: {input_weight: -1, output_weight: 1}}"), "models.m.input_weight: must not be negative"},
		{"infinite weight", withList("models: {m: {input_weight: 1, output_weight: .inf}}"), "models.m.output_weight: must be a finite number"},
		{"zero weights", withList("models: {m: {input_weight: 0, output_weight: 0}}"), "models.m: at least one weight must be positive"},
		{"null model", withList("models: {m: }"), "models.m: at least one weight must be positive"},
		{"empty model name", withList(`models: {"": {input_weight: 1}}`), `models[""]: model name must not be empty`},
		{"dotted model name", withList(`models: {"gpt-4.1": {input_weight: 2}}`), ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Parse([]byte(tt.src))
			got := ""
			if err != nil {
				got = err.Error()
			}
			if got != tt.want {
				t.Errorf("Parse(%q) error =\n%v\nwant\n%v", tt.src, got, tt.want)
			}
			if err != nil {
				var pe *Error
				if !errors.As(err, &pe) {
					t.Errorf("Parse(%q) error %v holds no *Error", tt.src, err)
				}
			}
		})
	}
}

func TestParseCollectsAllErrorsInOrder(t *testing.T) {
	const src = `
default_plan: gold
plans:
  pro:
    quotas: [{name: 5h, kind: rolling, window: 0, limit: 0}]
  free:
    quotas: [{name: a, kind: fixed, window: 1s, limit: 1}, {name: a, kind: fixed, window: 1s, limit: 1}]
tenants:
  zeta: {plan: nope}
  acme: {plan: gold}
endpoints:
  /b: {user: [{name: x, kind: balance}]}
  /a: {global: [{name: y, kind: token_bucket, per: 1s}]}
ip: [{name: i, kind: sliding_log, window: 1s, limit: 5000}]
models: {m: {input_weight: -1}}
`
	want := strings.Join([]string{
		`default_plan: plan "gold" is not defined`,
		`plans.free.quotas[1].name: duplicate name "a"`,
		`plans.pro.quotas[0].limit: must be positive`,
		`plans.pro.quotas[0].window: must be positive`,
		`tenants.acme.plan: plan "gold" is not defined`,
		`tenants.zeta.plan: plan "nope" is not defined`,
		`endpoints["/a"].global[0].burst: must be positive`,
		`endpoints["/b"].user[0].kind: balance is not allowed in endpoint user limits (allowed: rolling, fixed, calendar_month, token_bucket, sliding_log, concurrency)`,
		`ip[0].limit: must be at most 1000 for kind sliding_log (it stores one entry per request)`,
		`models.m.input_weight: must not be negative`,
	}, "\n")
	for range 3 { // map order must not matter
		_, err := Parse([]byte(src))
		if err == nil || err.Error() != want {
			t.Fatalf("Parse(%q) error =\n%v\nwant\n%v", src, err, want)
		}
	}
}

func TestParseShapeErrors(t *testing.T) {
	tests := []struct {
		name, src, want string
	}{
		{"unknown top-level field", "default_plan: free\nplans: {free: {}}\ndefaultplan: x",
			"defaultplan: unknown field (want default_plan, plans, tenants, endpoints, ip, models, shadow)"},
		{"unknown limit field", planWith("{name: a, kind: rolling, windw: 5h, limit: 1}"),
			"plans.free.quotas[0].windw: unknown field (want name, kind, unit, limit, window, buckets, rate, per, burst, shadow, alerts)"},
		{"unknown plan field", "default_plan: free\nplans: {free: {quota: []}}",
			"plans.free.quota: unknown field (want quotas, rates, shadow)"},
		{"unknown model field", withList("models: {m: {weight: 2}}"),
			"models.m.weight: unknown field (want input_weight, output_weight)"},
		{"unknown field in endpoint", withList("endpoints: {/x: {users: []}}"),
			`endpoints["/x"].users: unknown field (want global, user)`},
		{"unknown field via merge", "defaults: &d {kind: fixed, window: 1s, limt: 3}\ndefault_plan: free\nplans: {free: {quotas: [{<<: *d, name: a}]}}",
			"defaults: unknown field (want default_plan, plans, tenants, endpoints, ip, models, shadow)\nplans.free.quotas[0].limt: unknown field (want name, kind, unit, limit, window, buckets, rate, per, burst, shadow, alerts)"},
		{"fractional alert", planWith("{name: a, kind: fixed, window: 1s, limit: 1, alerts: [80.5]}"), "plans.free.quotas[0].alerts[0]: must be a whole number, got 80.5"},
		{"alerts not a list", planWith("{name: a, kind: fixed, window: 1s, limit: 1, alerts: 80}"), "plans.free.quotas[0].alerts: must be a list"},
		{"fractional limit", planWith("{name: a, kind: fixed, window: 1s, limit: 1.5}"), "plans.free.quotas[0].limit: must be a whole number, got 1.5"},
		{"string limit", planWith("{name: a, kind: fixed, window: 1s, limit: lots}"), `plans.free.quotas[0].limit: must be a whole number, got "lots"`},
		{"quoted limit", planWith(`{name: a, kind: fixed, window: 1s, limit: "10"}`), `plans.free.quotas[0].limit: must be a whole number, got "10"`},
		{"fractional buckets", planWith("{name: a, kind: rolling, window: 1h, limit: 1, buckets: 2.5}"), "plans.free.quotas[0].buckets: must be a whole number, got 2.5"},
		{"string rate", planWith("{name: a, kind: token_bucket, rate: fast, per: 1s, burst: 1}"), `plans.free.quotas[0].rate: must be a number, got "fast"`},
		{"days", planWith("{name: a, kind: fixed, window: 7d, limit: 1}"), `plans.free.quotas[0].window: invalid duration "7d": Go durations have no days, write "168h"`},
		{"bad duration", planWith("{name: a, kind: fixed, window: soon, limit: 1}"), `plans.free.quotas[0].window: invalid duration "soon": want a number and a unit (ms, s, m, h), e.g. "90s" or "5h"`},
		{"bare seconds", planWith("{name: a, kind: fixed, window: 3600, limit: 1}"), `plans.free.quotas[0].window: must be a duration with a unit, e.g. "30s" or "5h", got 3600`},
		{"duration list", planWith("{name: a, kind: fixed, window: [1s], limit: 1}"), `plans.free.quotas[0].window: must be a duration such as "30s" or "5h"`},
		{"bad shadow", "default_plan: free\nplans: {free: {shadow: maybe}}", `plans.free.shadow: must be true or false, got "maybe"`},
		{"quotas not a list", "default_plan: free\nplans: {free: {quotas: {name: a}}}", "plans.free.quotas: must be a list"},
		{"tenant plans not a list", withList("tenants: {acme: {plans: free}}"), "tenants.acme.plans: must be a list"},
		{"tenant plans of lists", withList("tenants: {acme: {plans: [[free]]}}"), "tenants.acme.plans[0]: must be a string"},
		{"unknown tenant field", withList("tenants: {acme: {plan_list: [free]}}"),
			"tenants.acme.plan_list: unknown field (want plan, plans, quotas, rates, shadow)"},
		{"plans a list", "default_plan: free\nplans: [free]", "plans: must be a mapping"},
		{"limit a mapping", planWith("{name: a, kind: fixed, window: 1s, limit: {n: 1}}"), "plans.free.quotas[0].limit: must be a whole number"},
		{"name a list", planWith("{name: [a], kind: fixed, window: 1s, limit: 1}"), "plans.free.quotas[0].name: must be a string"},
		{"root a list", "- a\n- b", "policy must be a mapping of default_plan, plans, tenants, endpoints, ip, models and shadow"},
		{"root a scalar", "hello", "policy must be a mapping of default_plan, plans, tenants, endpoints, ip, models and shadow"},
		{"empty", "", "policy is empty"},
		{"comments only", "# nothing here\n", "policy is empty"},
		{"two documents", withList("---\ndefault_plan: pro"), "policy holds more than one YAML document (line 3)"},
		{"syntax", "default_plan: free\nplans: {free: {}\n", "parse policy: yaml: line 1: did not find expected ',' or '}'"},
		{"duplicate key", "default_plan: free\nplans: {free: {}, free: {}}", "parse policy: yaml: unmarshal errors:\n  line 2: mapping key \"free\" already defined at line 2"},
		{"too large", withList("# " + strings.Repeat("x", MaxPolicySize)), "policy is larger than 1048576 bytes (1 MiB)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Parse([]byte(tt.src))
			if err == nil || err.Error() != tt.want {
				src := tt.src
				if len(src) > 200 {
					src = src[:200] + "..."
				}
				t.Errorf("Parse(%q) error =\n%v\nwant\n%v", src, err, tt.want)
			}
		})
	}
}

func TestParseAccepts(t *testing.T) {
	tests := []struct{ name, src string }{
		{"whole float limit", planWith("{name: a, kind: fixed, window: 1s, limit: 1e6}")},
		{"underscored limit", planWith("{name: a, kind: fixed, window: 1s, limit: 1_000}")},
		{"zero duration on unused field", planWith("{name: a, kind: calendar_month, limit: 5, window: 0}")},
		{"yes as bool", "default_plan: free\nplans: {free: {shadow: yes}}"},
		{"null plan", "default_plan: free\nplans: {free: }"},
		{"null endpoint and tenant", "default_plan: free\nplans: {free: {}}\nendpoints: {/x: }\ntenants: {acme: }"},
		{"anchors and merge", "default_plan: free\nplans:\n  free: &free {quotas: [&a {name: a, kind: fixed, window: 1s, limit: 3}]}\n  pro: {quotas: [{<<: *a, limit: 9}]}\n  copy: *free\n"},
		{"mixed units", planWith("{name: a, kind: fixed, window: 1m30s, limit: 1, unit: requests}")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := Parse([]byte(tt.src))
			if err != nil {
				t.Fatalf("Parse(%q) error = %v, want nil", tt.src, err)
			}
			if err := p.Validate(); err != nil {
				t.Errorf("Validate() after Parse(%q) = %v, want nil", tt.src, err)
			}
		})
	}
	p := mustParse(t, "default_plan: free\nplans: {free: {}}\nendpoints: {/x: }\ntenants: {acme: }")
	if p.Endpoints["/x"] == nil || p.Tenants["acme"] == nil {
		t.Errorf("Parse left null entries nil: %+v, %+v", p.Endpoints, p.Tenants)
	}
	if got := mustParse(t, planWith("{name: a, kind: fixed, window: 1s, limit: 1e6}")).Plans["free"].Quotas[0].Limit; got != 1_000_000 {
		t.Errorf("limit: 1e6 parsed as %d, want 1000000", got)
	}
}

func TestPolicyValidateBuiltInCode(t *testing.T) {
	p := &Policy{
		DefaultPlan: "free",
		Plans: map[string]*Plan{
			"free": {Quotas: []Limit{{Name: "day", Kind: Fixed, Window: Duration(86400e9), Limit: 10}}},
			"nil":  nil,
		},
		Tenants: map[string]*Tenant{"acme": nil},
	}
	if err := p.Validate(); err != nil {
		t.Fatalf("Validate() = %v, want nil", err)
	}
	r, err := p.Resolve("acme", "", "/x")
	if err != nil || len(r.Subject) != 1 || r.Subject[0].Unit != Tokens {
		t.Errorf("Resolve on a policy built in code = %+v, %v; want one tokens rule", r, err)
	}
	p.Plans["free"].Quotas[0].Window = 0
	if err := p.Validate(); err == nil || err.Error() != "plans.free.quotas[0].window: must be positive" {
		t.Errorf("Validate() = %v, want plans.free.quotas[0].window: must be positive", err)
	}
	if err := (*Policy)(nil).Validate(); err == nil {
		t.Error("Validate() of a nil policy = nil, want an error")
	}
}

func TestPolicyLoadFileErrors(t *testing.T) {
	dir := t.TempDir()
	if _, err := LoadFile(filepath.Join(dir, "missing.yaml")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("LoadFile(missing) error = %v, want os.ErrNotExist", err)
	}
	path := filepath.Join(dir, "policy.yaml")
	if err := os.WriteFile(path, []byte("default_plan: x\nplans: {free: {}}"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := LoadFile(path)
	if want := "load policy " + path + `: default_plan: plan "x" is not defined`; err == nil || err.Error() != want {
		t.Errorf("LoadFile error = %v, want %s", err, want)
	}
	big := filepath.Join(dir, "big.yaml")
	if err := os.WriteFile(big, make([]byte, 2*MaxPolicySize), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadFile(big); err == nil || !strings.Contains(err.Error(), "larger than 1048576 bytes") {
		t.Errorf("LoadFile(2 MiB) error = %v, want the size cap", err)
	}
}
