// Package limitstest holds what the tests of the limits engine and of its
// repair tools share: rules in one line, Limiters that move through time,
// checked reserves and peeks, and a client that counts round trips.
package limitstest

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
	"quotaflow/pkg/limits/repair"
)

// Rule binds l to scope, counting tokens unless l says otherwise.
func Rule(scope policy.Scope, l policy.Limit) policy.Rule {
	if l.Unit == "" {
		l.Unit = policy.Tokens
	}
	return policy.Rule{Limit: l, Scope: scope}
}

// At returns a Limiter without the epoch guard that sees Redis time
// shifted by offset: moving through windows without sleeping.
func At(c limits.Client, offset time.Duration) *limits.Limiter {
	return limits.New(c, limits.Options{NoEpochGuard: true, ClockOffset: offset})
}

// Reserve reserves cost for request id of (tenant, user) and fails the
// test on an error.
func Reserve(t *testing.T, l *limits.Limiter, tenant, user, id string, cost int64, rules []policy.Rule) limits.Decision {
	t.Helper()
	return ReserveRequest(t, l, limits.Request{Tenant: tenant, User: user, RequestID: id, Cost: cost, Rules: rules})
}

// Peek reports the limits of (tenant, user) and fails the test on an
// error.
func Peek(t *testing.T, l *limits.Limiter, tenant, user string, rules []policy.Rule) limits.Decision {
	t.Helper()
	d, err := l.Peek(context.Background(), limits.Request{Tenant: tenant, User: user, Rules: rules})
	if err != nil {
		t.Fatalf("Peek error = %v", err)
	}
	return d
}

// CountedShared returns a client of the shared Redis whose round trips
// are counted.
func CountedShared(t *testing.T) (*redis.Client, *Calls) {
	t.Helper()
	opt, err := redis.ParseURL(redistest.SharedURL())
	if err != nil {
		t.Fatal(err)
	}
	c := redis.NewClient(opt)
	t.Cleanup(func() { c.Close() })
	n := &Calls{}
	c.AddHook(n)
	return c, n
}

// Calls counts round trips like redistest.RoundTrips, but not the
// handshake of a new connection (HELLO, CLIENT SETINFO), whose timing
// depends on the pool.
type Calls struct{ redistest.RoundTrips }

// ProcessHook counts a command sent alone.
func (c *Calls) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	counted := c.RoundTrips.ProcessHook(next)
	return func(ctx context.Context, cmd redis.Cmder) error {
		if handshake(cmd) {
			return next(ctx, cmd)
		}
		return counted(ctx, cmd)
	}
}

// ProcessPipelineHook counts a pipeline.
func (c *Calls) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	counted := c.RoundTrips.ProcessPipelineHook(next)
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if len(cmds) > 0 && handshake(cmds[0]) {
			return next(ctx, cmds)
		}
		return counted(ctx, cmds)
	}
}

func handshake(cmd redis.Cmder) bool { return cmd.Name() == "hello" || cmd.Name() == "client" }

// Used lists what each limit of ss has used.
func Used(ss []limits.State) []int64 {
	out := make([]int64, len(ss))
	for i, s := range ss {
		out[i] = s.Used
	}
	return out
}

// RepairAt returns repair tools without the epoch guard that see Redis time
// shifted by offset, as At's Limiter does.
func RepairAt(c limits.Client, offset time.Duration) *repair.Tools {
	return repair.New(c, limits.Options{NoEpochGuard: true, ClockOffset: offset})
}

// ReserveRequest reserves r and fails the test on an error.
func ReserveRequest(t *testing.T, l *limits.Limiter, r limits.Request) limits.Decision {
	t.Helper()
	d, err := l.Reserve(context.Background(), r)
	if err != nil {
		t.Fatalf("Reserve(%s, %d) error = %v", r.RequestID, r.Cost, err)
	}
	return d
}
