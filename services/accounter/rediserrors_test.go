package main

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"quotaflow/internal/redistest"
)

// The hook counts what Redis failed, once per command or pipeline, under
// the op of the context, and nothing that is part of normal operation.
func TestRedisErrorsHook(t *testing.T) {
	s := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: s.Addr, MaxRetries: -1}) // fail at once when stopped
	t.Cleanup(func() { c.Close() })
	reg := prometheus.NewRegistry()
	h := newRedisErrors(reg)
	c.AddHook(h)
	ctx := withRedisOp(context.Background(), opConsume)
	count := func() float64 { return testutil.ToFloat64(h.errs.WithLabelValues(opConsume)) }

	// Normal operation: a missing key, a node without the engine loaded
	// yet, another instance's load of it, a canceled call, a refused
	// CONFIG GET; the connection's set-up ran on first use.
	if err := c.Get(ctx, "missing").Err(); err != redis.Nil {
		t.Fatalf("GET missing = %v, want redis.Nil", err)
	}
	if err := c.EvalSha(ctx, "ffffffffffffffffffffffffffffffffffffffff", nil).Err(); err == nil {
		t.Fatal("EVALSHA of an unknown script succeeded")
	}
	if err := c.FCall(ctx, "qf_no_such_function", nil).Err(); err == nil {
		t.Fatal("FCALL of an unknown function succeeded")
	}
	// Two instances loading the engine at once: the second load finds it.
	lib := "#!lua name=qf_hooktest\nredis.register_function('qf_hooktest_f', function() return 1 end)"
	for i := range 2 {
		if err := c.FunctionLoad(ctx, lib).Err(); (err != nil) != (i == 1) {
			t.Fatalf("FUNCTION LOAD %d = %v", i+1, err)
		}
	}
	pipe := c.Pipeline()
	pipe.Get(ctx, "missing")
	pipe.EvalSha(ctx, "ffffffffffffffffffffffffffffffffffffffff", nil)
	_, _ = pipe.Exec(ctx)
	canceled, cancel := context.WithCancel(ctx)
	cancel()
	_ = c.Get(canceled, "k").Err()
	// The eviction check's CONFIG GET, refused to an ACL user without
	// +config|get.
	if err := c.Do(ctx, "ACL", "SETUSER", "hooktest", "on", ">pw", "~*", "+@all", "-config").Err(); err != nil {
		t.Fatal(err)
	}
	limited := redis.NewClient(&redis.Options{Addr: s.Addr, Username: "hooktest", Password: "pw"})
	t.Cleanup(func() { limited.Close() })
	limited.AddHook(h)
	if err := limited.ConfigGet(ctx, "maxmemory-policy").Err(); err == nil {
		t.Fatal("CONFIG GET without +config succeeded")
	}
	if n := count(); n != 0 {
		t.Fatalf("redis errors after normal operation = %v, want 0", n)
	}

	// Failures: a command Redis refuses, a pipeline (one round trip) of
	// two, a command with Redis gone; none outside an op goes uncounted.
	if err := c.Do(ctx, "NOSUCHCOMMAND").Err(); err == nil {
		t.Fatal("an unknown command succeeded")
	}
	pipe = c.Pipeline()
	pipe.Do(ctx, "NOSUCHCOMMAND")
	pipe.Do(ctx, "NOSUCHCOMMAND")
	_, _ = pipe.Exec(ctx)
	if n := count(); n != 2 {
		t.Fatalf("redis errors = %v, want 2 (a command, a pipeline)", n)
	}
	s.Stop()
	if err := c.Get(ctx, "k").Err(); err == nil {
		t.Fatal("GET with Redis stopped succeeded")
	}
	if n := count(); n != 3 {
		t.Fatalf("redis errors = %v with Redis stopped, want 3", n)
	}
	_ = c.Get(context.Background(), "k").Err()
	if n := testutil.ToFloat64(h.errs.WithLabelValues(opOther)); n != 1 {
		t.Fatalf("redis errors outside an op = %v, want 1 under other", n)
	}
}
