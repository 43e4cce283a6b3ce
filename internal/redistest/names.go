package redistest

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/redis/go-redis/v9"

	"quotaflow/internal/e2e"
)

// UniqueName returns a name no other test run uses (the test's name and a
// random suffix), so tests sharing the development Redis own their keys:
// use it for tenants, endpoints and IPs.
func UniqueName(t testing.TB) string {
	return strings.ReplaceAll(t.Name(), "/", "_") + "-" + e2e.RandomHex(6)
}

// RoundTrips is a go-redis hook counting what a client sends: one per
// command, one per pipeline. Add it with client.AddHook.
type RoundTrips struct{ n atomic.Int64 }

// Count returns the round trips so far.
func (c *RoundTrips) Count() int64 { return c.n.Load() }

// DialHook passes dials through.
func (c *RoundTrips) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessHook counts a command.
func (c *RoundTrips) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.n.Add(1)
		return next(ctx, cmd)
	}
}

// ProcessPipelineHook counts a pipeline as one round trip.
func (c *RoundTrips) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		c.n.Add(1)
		return next(ctx, cmds)
	}
}

// Reset sets the count back to zero.
func (c *RoundTrips) Reset() { c.n.Store(0) }
