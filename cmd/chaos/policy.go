package main

import (
	"fmt"
	"time"

	"quotaflow/internal/e2e"
)

const endpoint = "/v1/chat"

// tenants of a run; a cluster run has more, so that their hash tags
// spread over every master's slots (checked before the load starts).
func (cfg Config) tenants() []string {
	ts := []string{"acme", "globex", "initech"}
	if cfg.Cluster {
		ts = append(ts, "hooli", "umbrella", "stark", "wayne", "tyrell", "wonka")
	}
	return ts
}

// chaosUsers: per tenant a light user, a medium one that crosses 80 % of
// the 5 h quota late in the run, a heavy one that crosses 100 % and gets
// 429s, and one in between; so alerts fire while faults are injected.
func (cfg Config) users() []e2e.User {
	var us []e2e.User
	for _, t := range cfg.tenants() {
		us = append(us,
			e2e.User{Tenant: t, Name: "light", Estimate: 300, Burst: 1},
			e2e.User{Tenant: t, Name: "steady", Estimate: 600, Burst: 1},
			e2e.User{Tenant: t, Name: "medium", Estimate: 1100, Burst: 1},
			e2e.User{Tenant: t, Name: "heavy", Estimate: 1600, Burst: 1})
	}
	return us
}

// quota5h sizes the 5 h quota to the run's expected length (about a
// second of recovery per fault): 1000 tokens per request a user sends,
// so the heavy users (~1360 actual tokens a request) run out after about
// three quarters of the run and the medium ones (~935) cross 80 % near
// its end.
func quota5h(cfg Config) int64 {
	n := len(cfg.faults())
	expected := time.Duration(n+1)*cfg.Gap + time.Duration(n)*(cfg.Down+time.Second)
	return int64(1000 * cfg.Rate * expected.Seconds())
}

func chaosPolicy(cfg Config) string {
	q := quota5h(cfg)
	return fmt.Sprintf(`# written by cmd/chaos
default_plan: chaos
plans:
  chaos:
    quotas:
      - {name: 5h, kind: rolling, window: 5h,   limit: %d}
      - {name: 7d, kind: rolling, window: 168h, limit: %d}
`, q, 20*q)
}
