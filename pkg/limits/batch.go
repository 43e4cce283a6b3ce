package limits

import (
	"context"
	"errors"

	"github.com/redis/go-redis/v9"
)

// Reserved is the outcome of one Request of ReserveBatch: what Reserve
// would have returned for it.
type Reserved struct {
	Decision Decision
	Err      error
}

// ReserveBatch makes the Reserve calls of rs in one pipelined round trip
// (one per Cluster node holding their subjects) and returns their outcomes
// in order. Each call is its own script run, so each is as atomic and exact
// as a lone Reserve; batching only saves the client's and Redis's per-call
// network work. A failing connection fails every call of the batch. A
// client that cannot pipeline gets the calls one after another.
func (l *Limiter) ReserveBatch(ctx context.Context, rs []Request) []Reserved {
	out := make([]Reserved, len(rs))
	if len(rs) == 1 {
		out[0].Decision, out[0].Err = l.Reserve(ctx, rs[0])
		return out
	}
	calls := make([]call, len(rs))
	for i := range rs {
		if err := rs[i].validate(); err != nil {
			calls[i].err = err
			continue
		}
		calls[i].keys, calls[i].args = l.subjectArgs(&rs[i], 0)
	}
	cmds := l.runAll(ctx, reserveEntry, calls)
	for i := range calls {
		if calls[i].err != nil {
			out[i].Err = calls[i].err
			continue
		}
		v, err := packedInts(cmds[i])
		out[i].Decision, out[i].Err = decodeDecision(v, err, &rs[i])
	}
	return out
}

// SettleOp is one settlement of SettleMany: a Correct, or a Release when
// Release is set. With IfGone too, the release applies only when Redis
// holds no record of the request id: it stands for a release that found
// none when it was made (admission's answer "unknown"), which must not undo
// a reservation the id got afterwards, yet gives back what a rebuild from
// the ledger put in the windows for it.
type SettleOp struct {
	Settle
	Release bool
	IfGone  bool
}

// SettleResult is what Correct or Release would have returned for one
// SettleOp.
type SettleResult struct {
	Settlement
	Err error
}

// SettleMany corrects or releases every op as Correct and Release do, with
// the same guarantees (each reservation settles once, the epoch is checked
// per op) and the same result as calling them one by one in order: Redis
// runs a pipeline's scripts in the order sent, so an op repeated within
// ops finds the earlier one's effect (AlreadySettled). The calls go out in
// one pipelined round trip (one per node of a Redis Cluster, since each
// op's keys share one slot) when the client pipelines (*redis.Client,
// *redis.ClusterClient, *redis.Ring), else one by one. An invalid op or a
// failed call fails only its own result.
func (l *Limiter) SettleMany(ctx context.Context, ops []SettleOp) []SettleResult {
	calls := make([]call, len(ops))
	for i := range ops {
		op := settleCorrect
		switch {
		case ops[i].Release && ops[i].IfGone:
			op = settleReleaseIfGone
		case ops[i].Release:
			op = settleRelease
		}
		calls[i] = l.settleCall(ops[i].Settle, op)
	}
	cmds := l.runAll(ctx, settleEntry, calls)
	out := make([]SettleResult, len(ops))
	for i := range calls {
		if calls[i].err != nil {
			out[i].Err = calls[i].err
			continue
		}
		out[i].Settlement, out[i].Err = parseSettlement(cmds[i], &calls[i])
	}
	return out
}

// ChargeResult is what Charge would have returned for one request of
// ChargeMany.
type ChargeResult struct {
	States []State
	Err    error
}

// ChargeMany charges every request as Charge does, in order, in one
// pipelined round trip like SettleMany.
func (l *Limiter) ChargeMany(ctx context.Context, reqs []ChargeRequest) []ChargeResult {
	calls := make([]call, len(reqs))
	for i := range reqs {
		calls[i] = l.chargeCall(reqs[i])
	}
	cmds := l.runAll(ctx, chargeEntry, calls)
	out := make([]ChargeResult, len(reqs))
	for i := range calls {
		if calls[i].err != nil {
			out[i].Err = calls[i].err
			continue
		}
		out[i].States, out[i].Err = parseCharge(cmds[i], &calls[i])
	}
	return out
}

// call is one prepared script call; err, when set, rejected its arguments
// and it is not sent.
type call struct {
	keys  []string
	args  []any
	rules []Rule // the rules the reply reports on, in order
	what  string // names the call in errors
	err   error
}

// pipeliner is what runAll needs to pipeline.
type pipeliner interface {
	Pipeline() redis.Pipeliner
}

// runAll runs entry e for every valid call and returns its command (nil
// for the invalid ones): as FCALL while the server serves functions, and
// again, after loading the library, for the ones a node answered that it
// lacks it; else as EVALSHA, and again as EVAL for the ones a node answered
// NOSCRIPT. Several calls go out in one pipeline per attempt when the
// client pipelines, a lone call as a plain command. A node misses the
// library or the script for all the calls it gets, so retried calls keep
// their order among themselves.
func (l *Limiter) runAll(ctx context.Context, e *entry, calls []call) []*redis.Cmd {
	cmds := make([]*redis.Cmd, len(calls))
	p, pipelines := l.rdb.(pipeliner)
	const (
		fcall = iota
		evalsha
		eval
	)
	send := func(how int, which []int) {
		var to Client = l.rdb
		var pipe redis.Pipeliner
		if pipelines && len(which) > 1 {
			pipe = p.Pipeline()
			to = pipe
		}
		for _, i := range which {
			c := &calls[i]
			switch how {
			case fcall:
				cmds[i] = to.FCall(ctx, e.fn, c.keys, c.args...)
			case evalsha:
				cmds[i] = e.script.EvalSha(ctx, to, c.keys, c.args...)
			default:
				cmds[i] = e.script.Eval(ctx, to, c.keys, c.args...)
			}
		}
		if pipe != nil {
			_, _ = pipe.Exec(ctx) // each command holds its own error
		}
	}
	// failed returns the calls of which whose command failed as match says.
	failed := func(which []int, match func(error) bool) []int {
		var out []int
		for _, i := range which {
			if match(cmds[i].Err()) {
				out = append(out, i)
			}
		}
		return out
	}
	valid := make([]int, 0, len(calls))
	for i := range calls {
		if calls[i].err == nil {
			valid = append(valid, i)
		}
	}
	if len(valid) == 0 {
		return cmds
	}
	if l.usesFunctions(e) {
		seen := l.loads.Load()
		send(fcall, valid)
		missing := failed(valid, isNoFunction)
		for try := 0; len(missing) > 0 && try < loadTries; try++ {
			if err := l.loadEngine(ctx, seen); err != nil {
				for _, i := range missing {
					cmds[i].SetErr(err)
				}
				break
			}
			seen = l.loads.Load()
			send(fcall, missing)
			missing = failed(missing, isNoFunction)
		}
		valid = failed(valid, functionsUnavailable)
		if len(valid) == 0 {
			return cmds
		}
		l.scriptsOnly.Store(true)
	}
	send(evalsha, valid)
	if missing := failed(valid, isNoScript); len(missing) > 0 {
		send(eval, missing)
	}
	return cmds
}

// isNoScript reports whether err says the node has not cached the script,
// in either form go-redis hands it over.
func isNoScript(err error) bool {
	return err != nil && (errors.Is(err, redis.ErrNoScript) || redis.HasErrorPrefix(err, "NOSCRIPT"))
}
