package limits

import (
	"context"

	"quotaflow/pkg/limits/internal/script"
	"quotaflow/pkg/limits/internal/wire"
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
	calls := make([]wire.Call, len(rs))
	for i := range rs {
		calls[i] = l.reserveCall(&rs[i], wire.ModeReserve)
	}
	cmds := l.run.RunAll(ctx, script.Reserve, calls)
	for i := range calls {
		if calls[i].Err != nil {
			out[i].Err = calls[i].Err
			continue
		}
		out[i].Decision, out[i].Err = decodeDecision(cmds[i], &calls[i], &rs[i])
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
	calls := make([]wire.Call, len(ops))
	for i := range ops {
		op := wire.SettleCorrect
		switch {
		case ops[i].Release && ops[i].IfGone:
			op = wire.SettleReleaseIfGone
		case ops[i].Release:
			op = wire.SettleRelease
		}
		calls[i] = l.settleCall(&ops[i].Settle, op)
	}
	cmds := l.run.RunAll(ctx, script.Settle, calls)
	out := make([]SettleResult, len(ops))
	for i := range calls {
		if calls[i].Err != nil {
			out[i].Err = calls[i].Err
			continue
		}
		out[i].Settlement, out[i].Err = decodeSettlement(cmds[i], &calls[i])
	}
	return out
}
