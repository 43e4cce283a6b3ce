package redistest

import (
	"context"
	"errors"
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

// ScriptHook is a go-redis hook that, once F is set, runs each script call
// (FCALL, EVALSHA or EVAL, alone or in a pipeline) through F, which calls
// next to send it: a test's way to act between a client's round trips or
// to fail one. Add it with client.AddHook.
type ScriptHook struct {
	F atomic.Pointer[func(cmds []redis.Cmder, next func() error) error]
}

// DialHook passes dials through.
func (h *ScriptHook) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessHook runs a script command through F.
func (h *ScriptHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		return h.run([]redis.Cmder{cmd}, func() error { return next(ctx, cmd) })
	}
}

// ProcessPipelineHook runs a pipeline holding a script command through F.
func (h *ScriptHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		return h.run(cmds, func() error { return next(ctx, cmds) })
	}
}

// FailAfter sets F to send the next n script calls and fail every one
// after them, as a dropped connection would.
func (h *ScriptHook) FailAfter(n int32) {
	var calls atomic.Int32
	f := func(cmds []redis.Cmder, next func() error) error {
		if calls.Add(1) <= n {
			return next()
		}
		err := errors.New("redistest: injected failure")
		for _, c := range cmds {
			c.SetErr(err)
		}
		return err
	}
	h.F.Store(&f)
}

func (h *ScriptHook) run(cmds []redis.Cmder, next func() error) error {
	if f := h.F.Load(); f != nil {
		for _, c := range cmds {
			switch c.Name() {
			case "fcall", "evalsha", "eval":
				return (*f)(cmds, next)
			}
		}
	}
	return next()
}
