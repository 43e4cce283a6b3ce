package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/internal/config"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
)

// run plays the scenario on the policy in QF_POLICY_FILE (default
// deploy/policy.yaml) and the Redis in QF_REDIS_URL.
func run(ctx context.Context, out io.Writer) error {
	policyFile := config.PolicyFile()
	pol, err := policy.LoadFile(policyFile)
	if err != nil {
		return err
	}
	opt, err := redis.ParseURL(config.RedisURL())
	if err != nil {
		return fmt.Errorf("QF_REDIS_URL: %w", err)
	}
	rdb := redis.NewClient(opt)
	defer rdb.Close()
	if err := rdb.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("redis: %w (start it with `go tool task deps`)", err)
	}

	// A tenant of its own per run, so the demo starts from empty windows and
	// never touches anybody else's counters. No accounter runs here, so the
	// epoch guard (which waits for the ledger rebuild) is off.
	tenant := fmt.Sprintf("demo-%d", time.Now().UnixNano())
	const user = "alice"
	res, err := pol.Resolve(tenant, "", "")
	if err != nil {
		return err
	}
	rules := res.Subject
	var quota int64
	for _, r := range rules {
		if r.Name == "5h" {
			quota = r.Limit.Limit
		}
	}
	fmt.Fprintf(out, "policy %s: tenant %s, user %s, plan %s\n", policyFile, tenant, user, res.Plan)
	for _, r := range rules {
		fmt.Fprintf(out, "  %-6s %-5s %-13s %s\n", r.Scope, r.Name, r.Kind, describe(&r))
	}
	fmt.Fprintln(out)

	at := func(offset time.Duration) *limits.Limiter {
		return limits.New(rdb, limits.Options{NoEpochGuard: true, ClockOffset: offset})
	}
	l := at(0)
	est := quota * 2 / 5 // each request estimates 40% of the 5 h quota
	reserve := func(step, id string, lim *limits.Limiter) error {
		d, err := lim.Reserve(ctx, limits.Request{Tenant: tenant, User: user, RequestID: id, Cost: est, Rules: rules})
		if err != nil {
			return err
		}
		printDecision(out, step, id, est, &d)
		return nil
	}

	steps := []struct {
		title string
		do    func() error
	}{
		{"admit a request estimated at " + fmt.Sprint(est) + " tokens", func() error { return reserve("1", "req-1", l) }},
		{"and another", func() error { return reserve("2", "req-2", l) }},
		{"a third does not fit in the 5 h window: 429 with Retry-After", func() error { return reserve("3", "req-3", l) }},
		{"req-1 actually used 100 tokens: the correction gives the rest back", func() error {
			s, err := l.Correct(ctx, limits.Settle{Tenant: tenant, User: user, RequestID: "req-1", Actual: 100, Rules: rules})
			if err != nil {
				return err
			}
			fmt.Fprintf(out, "   correct req-1 to 100 tokens: delta %+d, 5h used %d of %d\n", s.Delta, used(s.States, "5h"), quota)
			return nil
		}},
		{"the same correction again changes nothing (exactly once)", func() error {
			s, err := l.Correct(ctx, limits.Settle{Tenant: tenant, User: user, RequestID: "req-1", Actual: 100, Rules: rules})
			if err != nil {
				return err
			}
			fmt.Fprintf(out, "   correct req-1 again: %s, 5h used %d\n", settleStatus(s.Status), used(s.States, "5h"))
			return nil
		}},
		{"now req-3 fits", func() error { return reserve("6", "req-3", l) }},
		{"the gateway retries req-3: the stored decision, nothing charged", func() error { return reserve("7", "req-3", l) }},
		{"req-2 failed before using tokens: release gives its estimate back", func() error {
			s, err := l.Release(ctx, limits.Settle{Tenant: tenant, User: user, RequestID: "req-2", Rules: rules})
			if err != nil {
				return err
			}
			fmt.Fprintf(out, "   release req-2: delta %+d, 5h used %d of %d\n", s.Delta, used(s.States, "5h"), quota)
			return nil
		}},
		{"five hours later the window has slid past everything", func() error {
			d, err := at(5*time.Hour+time.Minute).Peek(ctx, limits.Request{Tenant: tenant, User: user, Rules: rules})
			if err != nil {
				return err
			}
			fmt.Fprintf(out, "   5h used %d of %d; 7d used %d (the week still remembers)\n", used(d.States, "5h"), quota, used(d.States, "7d"))
			return nil
		}},
	}
	for i, s := range steps {
		fmt.Fprintf(out, "%d. %s\n", i+1, s.title)
		if err := s.do(); err != nil {
			return err
		}
	}
	return nil
}

func printDecision(out io.Writer, step, id string, cost int64, d *limits.Decision) {
	verdict := "200 allowed"
	switch {
	case d.Duplicate:
		verdict = "200 allowed (duplicate: nothing charged)"
	case !d.Allowed:
		denied := d.States[d.DeniedBy].Rule
		verdict = fmt.Sprintf("429 denied by %s %s, Retry-After %s", denied.Scope, denied.Name, d.RetryAfter.Round(time.Second))
	}
	fmt.Fprintf(out, "   admit %s (%d tokens): %s\n", id, cost, verdict)
	var parts []string
	for _, s := range d.States {
		parts = append(parts, fmt.Sprintf("%s %d/%d", s.Rule.Name, s.Used, s.Limit))
	}
	fmt.Fprintf(out, "     used: %s\n", strings.Join(parts, ", "))
}

func used(states []limits.State, name string) int64 {
	for _, s := range states {
		if s.Rule.Name == name {
			return s.Used
		}
	}
	return 0
}

func settleStatus(s limits.SettleStatus) string {
	switch s {
	case limits.Settled:
		return "applied"
	case limits.AlreadySettled:
		return "already settled"
	case limits.ChargedUnknown:
		return "no reservation: charged in full"
	default:
		return "no reservation: nothing to release"
	}
}

func describe(r *policy.Rule) string {
	switch r.Kind {
	case policy.TokenBucket:
		return fmt.Sprintf("%g %s per %s, burst %d", r.Rate, r.Unit, time.Duration(r.Per), r.Burst)
	case policy.Rolling, policy.Fixed, policy.SlidingLog:
		return fmt.Sprintf("%d %s per %s", r.Limit.Limit, r.Unit, time.Duration(r.Window))
	default:
		return fmt.Sprintf("%d %s", r.Limit.Limit, r.Unit)
	}
}
