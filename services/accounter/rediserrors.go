package main

import (
	"context"
	"errors"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
)

// The accounter's tasks that call Redis, the op label of
// quotaflow_redis_errors_total (admission labels its own calls the same
// way): consume (a batch's corrections), epoch (the epoch check and the
// rebuild), expiry (settling expired reservations), reconcile; other for a
// call made outside them.
const (
	opConsume   = "consume"
	opEpoch     = "epoch"
	opExpiry    = "expiry"
	opReconcile = "reconcile"
	opOther     = "other"
)

type redisOpKey struct{}

// withRedisOp marks the Redis calls made under ctx as op's.
func withRedisOp(ctx context.Context, op string) context.Context {
	return context.WithValue(ctx, redisOpKey{}, op)
}

// redisErrors is a go-redis hook counting the calls (a command, or a
// pipeline: one round trip) that Redis failed, by the op of their context.
// Not failures: a nil reply; a node that has not loaded the limits engine
// yet ("Function not found", NOSCRIPT: pkg/limits loads it and calls again
// at once, as after every restart of Redis); a call whose context was
// canceled (shutdown), which says nothing about Redis; and the commands
// go-redis sends itself to set up a connection (HELLO, CLIENT SETINFO,
// CLIENT MAINT_NOTIFICATIONS), which Redis 7.0 may refuse and go-redis does
// without; and CONFIG GET of the eviction check, which an ACL or a managed
// Redis may refuse by design. The accounter sends neither HELLO nor CLIENT
// itself.
type redisErrors struct {
	errs *prometheus.CounterVec
}

func newRedisErrors(reg prometheus.Registerer) *redisErrors {
	h := &redisErrors{errs: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "quotaflow_redis_errors_total",
		Help: "Redis calls (commands or pipelines) by the accounter that failed or timed out, by task.",
	}, []string{"op"})}
	for _, op := range []string{opConsume, opEpoch, opExpiry, opReconcile, opOther} {
		h.errs.WithLabelValues(op)
	}
	reg.MustRegister(h.errs)
	return h
}

func (h *redisErrors) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *redisErrors) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if failed(ctx, cmd.Name(), err) {
			h.count(ctx)
		}
		return err
	}
}

func (h *redisErrors) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds) // the first error of cmds, each of which holds its own
		for _, cmd := range cmds {
			if failed(ctx, cmd.Name(), cmd.Err()) {
				h.count(ctx)
				break
			}
		}
		return err
	}
}

func (h *redisErrors) count(ctx context.Context) {
	op, _ := ctx.Value(redisOpKey{}).(string)
	if op == "" {
		op = opOther
	}
	h.errs.WithLabelValues(op).Inc()
}

// failed reports whether command name, sent under ctx, failed with err
// because of Redis.
func failed(ctx context.Context, name string, err error) bool {
	switch {
	case err == nil, errors.Is(err, redis.Nil), errors.Is(ctx.Err(), context.Canceled):
		return false
	case errors.Is(err, redis.ErrNoScript), redis.HasErrorPrefix(err, "NOSCRIPT"), redis.HasErrorPrefix(err, "Function not found"):
		return false
	case name == "function" && strings.Contains(err.Error(), "already exists"):
		return false // another instance loaded the limits engine first
	}
	return name != "hello" && name != "client" && name != "config"
}

var _ redis.Hook = (*redisErrors)(nil)
