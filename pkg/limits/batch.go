package limits

import (
	"context"
	"errors"
	"fmt"

	"quotaflow/pkg/limits/internal/script"
	"quotaflow/pkg/limits/internal/wire"
)

// Reserved is the outcome of one Request of ReserveBatch: what Reserve
// would have returned for it.
type Reserved struct {
	Decision Decision
	Err      error
}

// ReserveBatch makes the Reserve calls of rs and returns their outcomes in
// order: each is what Reserve would have returned for it, had the calls
// been made one after another in rs's order (with one Redis time for all).
// They go out as one script call (reserve.lua decides each in turn,
// all-or-nothing, atomically) per wire.MaxBatch reserves, and on a Redis
// Cluster or Ring per hash slot too, since a call's keys must share one;
// the calls in one pipelined round trip. So Redis pays a call's fixed cost
// (its dispatch, TIME, reading the keys, writing a blob several reserves
// changed, the reply) once per batch instead of once per reserve. An
// invalid request fails alone; a failing connection fails every request of
// its call.
func (l *Limiter) ReserveBatch(ctx context.Context, rs []Request) []Reserved {
	return l.reserve(ctx, rs, wire.ModeReserve)
}

// reserve makes the reserve calls of rs in mode (Fresh requests reserve in
// ModeFresh), batched as ReserveBatch says.
func (l *Limiter) reserve(ctx context.Context, rs []Request, mode int) []Reserved {
	out := make([]Reserved, len(rs))
	type group struct {
		slot  uint16
		batch *wire.ReserveBatch
		which []int // the index in rs of each of batch's reserves
	}
	var groups []group
	bySlot := l.run.SlotBound()
	for i := range rs {
		r := &rs[i]
		var slot uint16
		if bySlot {
			slot = wire.TenantSlot(r.Tenant)
		}
		g := -1
		for k := len(groups) - 1; k >= 0; k-- {
			if groups[k].slot == slot {
				g = k
				break
			}
		}
		if g < 0 || groups[g].batch.Len() == wire.MaxBatch {
			g = len(groups)
			groups = append(groups, group{slot: slot, batch: l.p.NewReserveBatch()})
		}
		m := mode
		if m == wire.ModeReserve && r.Fresh {
			m = wire.ModeFresh
		}
		if err := groups[g].batch.Add(r.Tenant, r.User, r.RequestID, r.Cost, m, r.Fingerprint, r.Nonce, r.Rules); err != nil {
			out[i].Err = err
			continue
		}
		groups[g].which = append(groups[g].which, i)
	}
	calls := make([]wire.Call, len(groups))
	for k := range groups {
		if groups[k].batch.Len() == 0 {
			calls[k].Err = ErrInvalid // nothing to send: its requests hold their errors
			continue
		}
		calls[k] = groups[k].batch.Call()
	}
	cmds := l.run.RunAll(ctx, script.Reserve, calls)
	for k := range calls {
		if calls[k].Err != nil {
			continue
		}
		which := groups[k].which
		wire.DecodeReserves(cmds[k], &calls[k], func(j int, v wire.ReserveReply, err error) {
			r, o := &rs[which[j]], &out[which[j]]
			if err != nil {
				if !errors.Is(err, ErrNoEpoch) {
					err = fmt.Errorf("reserve %s/%s: %w", r.Tenant, r.User, err)
				}
				o.Err = err
				return
			}
			o.Decision = decision(v, r.Rules)
		})
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
