package e2e_test

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/internal/e2e"
)

// slowPolicy limits one plan's users in tokens, requests and requests in
// flight, so that a reserve left behind in Redis shows in each.
const slowPolicy = `
default_plan: slow
plans:
  slow:
    quotas: [{name: 5h, kind: rolling, window: 5h, limit: 100000}]
    rates:
      - {name: hourly, kind: sliding_log, window: 1h, limit: 100}
      - {name: inflight, kind: concurrency, limit: 5}
`

// TestHostileSlowReserve is item 11 of the hostile-caller suite (issue 11):
// a reserve that times out is decided locally, yet Redis runs it when it
// answers again. Admission voids such reserves once Redis is back, so a
// request denied locally holds nothing in Redis and one allowed locally is
// charged once, its actual in full.
func TestHostileSlowReserve(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the services and runs them against the real servers")
	}
	t.Parallel() // a stack of its own, so it may overlap TestHostile
	token := "gw-" + e2e.RandomHex(8)
	s := startStack(t, stackConfig{
		policy: slowPolicy,
		tokens: []string{token},
		// Admission's default deadline, so that a Redis made to sleep
		// times calls out; every subject here is new to it, so it decides
		// those by the unseen allowance.
		admission: []string{"QF_REDIS_TIMEOUT=10ms", "QF_UNSEEN_ALLOWANCE=1000"},
		// No reconciliation: its repairs would make a double charge look
		// right in the end.
		accounter: []string{"QF_RECONCILE_INTERVAL=0"},
		redisArgs: []string{"--enable-debug-command", "yes"},
	})
	gw := s.as(t, token)
	const tenant = "slow"

	// Past the allowance: denied locally, though Redis would admit it.
	r := s.admitWhileRedisSleeps(t, gw, admitReq{RequestID: "big", Tenant: tenant, User: "denied", Endpoint: "/v1/chat", Estimate: 5000})
	if r.code != http.StatusTooManyRequests {
		t.Fatalf("admit past the unseen allowance while Redis sleeps = %s, want 429", r)
	}
	for name, want := range map[string]int64{"5h": 0, "hourly": 0, "inflight": 0} {
		if used := gw.used(tenant, "denied", "", name); used != want {
			t.Errorf("the request denied locally left %d in %s, want %d", used, name, want)
		}
	}

	// Within the allowance: allowed locally. Redis runs the lost reserve
	// when it wakes, before the actual comes; the actual is the request's
	// one charge, in full, whatever the reserve held meanwhile.
	r = s.admitWhileRedisSleeps(t, gw, admitReq{RequestID: "small", Tenant: tenant, User: "allowed", Endpoint: "/v1/chat", Estimate: 100})
	if r.code != http.StatusOK {
		t.Fatalf("admit within the unseen allowance while Redis sleeps = %s, want 200", r)
	}
	if r := gw.report(actualEvent("evt-small", tenant, "allowed", "small", 80, 0, time.Now())); r.code != http.StatusAccepted {
		t.Fatalf("report the actual = %s, want 202", r)
	}
	e2e.EventuallyLast(t, "the actual settled in the ledger", func() (bool, string) {
		st, actual := s.reservation(t, tenant, "allowed", "small")
		return st == "settled" && actual == 80, fmt.Sprintf("reservation %q, actual %d", st, actual)
	})
	// The ledger commits after Redis is corrected: nothing is on its way.
	for name, want := range map[string]int64{"5h": 80, "hourly": 1, "inflight": 0} {
		if used := gw.used(tenant, "allowed", "", name); used != want {
			t.Errorf("the request allowed locally holds %d in %s, want %d", used, name, want)
		}
	}
}

// admitWhileRedisSleeps sends the admit while the stack's Redis sleeps
// (DEBUG SLEEP): admission's reserve times out and is decided locally, and
// Redis runs it when it wakes, as after a latency spike. It waits until
// admission has voided the lost reserve.
func (s *stack) admitWhileRedisSleeps(t *testing.T, c caller, req admitReq) reply {
	t.Helper()
	const metricVoids = "quotaflow_admission_reserve_voids_total"
	local0 := metric(t, s.admission, "quotaflow_admission_decisions_total", "result", "failopen")
	voids0 := metric(t, s.admission, metricVoids) - metric(t, s.admission, metricVoids, "result", "retry")
	// An idle connection in admission's pool, so that the reserve goes out
	// on it at once rather than waiting for a new one's handshake (which
	// would time out before the reserve is sent, and it would never run).
	c.usage(req.Tenant, req.User, req.Plan)

	sleeper := redis.NewClient(&redis.Options{Addr: s.redis.Addr, ReadTimeout: time.Minute})
	defer sleeper.Close()
	slept := make(chan error, 1)
	go func() { slept <- sleeper.Do(context.Background(), "DEBUG", "SLEEP", "1.5").Err() }()
	// Asleep once a PING goes unanswered.
	probe := redis.NewClient(&redis.Options{Addr: s.redis.Addr, ReadTimeout: 200 * time.Millisecond, MaxRetries: -1})
	defer probe.Close()
	e2e.EventuallyLast(t, "redis asleep", func() (bool, string) {
		err := probe.Ping(context.Background()).Err()
		return err != nil, fmt.Sprintf("PING = %v", err)
	})
	r := c.admit(req)
	if err := <-slept; err != nil {
		t.Fatalf("DEBUG SLEEP: %v", err)
	}
	if n := metric(t, s.admission, "quotaflow_admission_decisions_total", "result", "failopen"); n == local0 {
		t.Fatalf("admit %s = %s was decided by Redis, not locally: Redis woke up too early", req.RequestID, r)
	}
	e2e.EventuallyLast(t, "the lost reserve voided", func() (bool, string) {
		n := metric(t, s.admission, metricVoids) - metric(t, s.admission, metricVoids, "result", "retry")
		return n > voids0, fmt.Sprintf("%v voids", n-voids0)
	})
	return r
}
