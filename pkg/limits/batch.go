package limits

import (
	"context"

	"github.com/redis/go-redis/v9"
)

// Reserved is the outcome of one Request of ReserveBatch: what Reserve
// would have returned for it.
type Reserved struct {
	Decision Decision
	Err      error
}

// pipeliner is a client that can send several commands in one write and
// read their replies in one go: *redis.Client, *redis.ClusterClient (one
// pipeline per node) and the other go-redis clients.
type pipeliner interface {
	Pipeline() redis.Pipeliner
}

// ReserveBatch makes the Reserve calls of rs in one pipelined round trip
// (one per Cluster node holding their subjects) and returns their outcomes
// in order. Each call is its own script run, so each is as atomic and exact
// as a lone Reserve; batching only saves the client's and Redis's per-call
// network work, which dominates a script this short. A failing connection
// fails every call of the batch. A client that cannot pipeline gets the
// calls one after another.
func (l *Limiter) ReserveBatch(ctx context.Context, rs []Request) []Reserved {
	out := make([]Reserved, len(rs))
	p, ok := l.rdb.(pipeliner)
	if !ok || len(rs) == 1 {
		for i := range rs {
			out[i].Decision, out[i].Err = l.Reserve(ctx, rs[i])
		}
		return out
	}
	type call struct {
		keys []string
		args []any
		cmd  *redis.Cmd
	}
	calls := make([]call, len(rs))
	pipe := p.Pipeline()
	for i := range rs {
		if err := rs[i].validate(); err != nil {
			out[i].Err = err
			continue
		}
		c := &calls[i]
		c.keys, c.args = l.subjectArgs(&rs[i], 0)
		c.cmd = reserveScript.EvalSha(ctx, pipe, c.keys, c.args...)
	}
	if pipe.Len() == 0 {
		return out
	}
	// Each command carries its own error; Exec's is the first of them.
	_, _ = pipe.Exec(ctx)

	// NOSCRIPT: the node's script cache is empty (a restart, a failover, a
	// SCRIPT FLUSH). Send those calls again with the script itself, which
	// also caches it, as Script.Run does for a single call.
	var retry redis.Pipeliner
	for i := range calls {
		c := &calls[i]
		if c.cmd != nil && redis.HasErrorPrefix(c.cmd.Err(), "NOSCRIPT") {
			if retry == nil {
				retry = p.Pipeline()
			}
			c.cmd = reserveScript.Eval(ctx, retry, c.keys, c.args...)
		}
	}
	if retry != nil {
		_, _ = retry.Exec(ctx)
	}

	for i := range calls {
		if c := &calls[i]; c.cmd != nil {
			v, err := c.cmd.Int64Slice()
			out[i].Decision, out[i].Err = decodeDecision(v, err, &rs[i])
		}
	}
	return out
}
