// Package plans holds the policy the benchmarks load admission with, so
// that "five limits" is one plan in every benchmark and results table.
package plans

// Five is issue 13's five limits for tenant bench: three rolling token
// windows (5 h, 7 d, 30 d), a request token bucket and a per-user limit on
// endpoint /x, each sized never to deny, so a run measures the work of
// five limits and never a denial.
const Five = `default_plan: five
plans:
  five:
    quotas:
      - {name: 5h,  kind: rolling, window: 5h,   limit: 1000000000}
      - {name: 7d,  kind: rolling, window: 168h, limit: 1000000000}
      - {name: 30d, kind: rolling, window: 720h, limit: 1000000000}
    rates:
      - {name: rps, kind: token_bucket, rate: 1000000, per: 1s, burst: 1000000}
tenants:
  bench: {plan: five}
endpoints:
  /x:
    user: [{name: daily, kind: fixed, window: 24h, limit: 1000000000}]
`
