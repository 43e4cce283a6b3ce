package limits

import (
	"context"
	"errors"
	"fmt"

	"github.com/redis/go-redis/v9"

	"quotaflow/pkg/limits/internal/script"
	"quotaflow/pkg/limits/internal/wire"
	"quotaflow/pkg/limits/policy"
)

// Reserved is the outcome of one Request of ReserveBatch: what Reserve
// would have returned for it.
type Reserved struct {
	Decision Decision
	Err      error
	// GiveBack is CountBatch's failure to give back what the other slots'
	// parts of this denied or failed group took (Redis Cluster or Ring):
	// that charge stays counted until its window ends.
	GiveBack error
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

// reserveBlobs makes the reserve calls of rs in mode (Fresh requests
// reserve in ModeFresh) in the subjects' blobs, batched as ReserveBatch
// says.
func (l *Limiter) reserveBlobs(ctx context.Context, rs []Request, mode int) []Reserved {
	out := make([]Reserved, len(rs))
	groups := batches(l, len(rs), func(i int) uint16 { return wire.TenantSlot(rs[i].Tenant) }, nil, l.p.NewReserveBatch,
		func(b *wire.ReserveBatch, i int) error {
			r := &rs[i]
			m := mode
			if m == wire.ModeReserve && r.Fresh {
				m = wire.ModeFresh
			}
			if l.general != "" && r.Tenant == l.general {
				m += wire.General
			}
			err := b.Add(r.Tenant, r.User, r.RequestID, r.Cost, m, r.Fingerprint, r.Nonce, r.Rules)
			out[i].Err = err
			return err
		})
	l.runReserves(ctx, groups, out, func(i int) []policy.Rule { return rs[i].Rules },
		func(i int) string { return rs[i].Tenant + "/" + rs[i].User })
	return out
}

// runReserves sends the reserve calls of groups in one round trip and
// records each entry's outcome in out: rules gives entry i's rules, name
// names it in an error.
func (l *Limiter) runReserves(ctx context.Context, groups []group[*wire.ReserveBatch], out []Reserved, rules func(i int) []policy.Rule, name func(i int) string) {
	calls := groupCalls(groups)
	cmds := l.run.RunAll(ctx, script.Reserve, calls)
	for k := range calls {
		if calls[k].Err != nil {
			continue
		}
		which := groups[k].which
		wire.DecodeReserves(cmds[k], &calls[k], func(j int, v wire.ReserveReply, err error) {
			i := which[j]
			if err != nil {
				if !errors.Is(err, ErrNoEpoch) {
					err = fmt.Errorf("reserve %s: %w", name(i), err)
				}
				out[i].Err = err
				return
			}
			out[i].Decision = decision(v, rules(i))
		})
	}
}

// SharedRequest is one entry of a CountBatch group: Cost in the shared
// limits Rules of Scope's ID, as ReserveShared takes them.
type SharedRequest struct {
	Scope policy.Scope
	// Tenant, when set, keeps the counters in that tenant's hash slot,
	// beside its other keys and under its epoch key, instead of the slot
	// of ID's own tag: a group of one tenant's counters is then one script
	// call on a Redis Cluster, and reads one epoch key. ID names the
	// counter all the same (one ID is one counter only with one Tenant).
	Tenant string
	ID     string
	Cost   int64
	Rules  []policy.Rule
}

// group is one batch call: its batch, the hash slot its keys share (0
// unless the client is slot bound) and the index of each of its entries
// among the caller's.
type group[B batch] struct {
	slot  uint16
	batch B
	which []int
}

// batch is a wire.ReserveBatch, wire.SettleBatch or wire.CountBatch.
type batch interface {
	Len() int
	Keys() int
	Call() wire.Call
}

// batches puts entries 0..n-1 into batches made by fresh, one per
// wire.MaxBatch entries and, on a Redis Cluster or Ring, per hash slot of
// the entry's keys too (slotOf), since a call's keys must share one. keys,
// when set, gives the most keys entry i adds, and a batch takes no entry
// that could bring it past wire.MaxCountKeys (an empty one takes any). add
// adds entry i to b; an entry it fails (the caller records why) is in no
// batch.
func batches[B batch](l *Limiter, n int, slotOf func(i int) uint16, keys func(i int) int, fresh func() B, add func(b B, i int) error) []group[B] {
	var groups []group[B]
	bySlot := l.run.SlotBound()
	for i := range n {
		var slot uint16
		if bySlot {
			slot = slotOf(i)
		}
		g := -1
		for k := len(groups) - 1; k >= 0; k-- {
			if groups[k].slot == slot {
				g = k
				break
			}
		}
		if g < 0 || groups[g].batch.Len() == wire.MaxBatch ||
			keys != nil && groups[g].batch.Len() > 0 && groups[g].batch.Keys()+keys(i) > wire.MaxCountKeys {
			g = len(groups)
			groups = append(groups, group[B]{slot: slot, batch: fresh()})
		}
		if add(groups[g].batch, i) == nil {
			groups[g].which = append(groups[g].which, i)
		}
	}
	return groups
}

// groupCalls returns the call of each group; one whose entries all failed
// is not sent (its entries hold their errors).
func groupCalls[B batch](groups []group[B]) []wire.Call {
	calls := make([]wire.Call, len(groups))
	for k := range groups {
		if groups[k].batch.Len() == 0 {
			calls[k].Err = ErrInvalid
			continue
		}
		calls[k] = groups[k].batch.Call()
	}
	return calls
}

// settleRounds splits the calls of groups, in order, into round trips that
// each send at most one call of a hash slot (on one node, one call). Redis
// reads a client's pipeline 16 KiB at a time and runs every call in what it
// read before it serves another client; a settle call of wire.MaxBatch
// corrections runs ~1.6 ms, so the accounter's batches of ~10 calls in one
// pipeline held admission's reserves back by several ms each: the admit's
// p99 in bench-pipeline fell by a quarter with one call at a time
// (bench/results.md, issue 13, session 21). A Redis Cluster's slots still
// go out together.
func settleRounds(groups []group[*wire.SettleBatch]) [][]int {
	var rounds [][]int
	taken := map[uint16]int{} // calls of a slot placed so far
	for k, g := range groups {
		n := taken[g.slot]
		taken[g.slot] = n + 1
		if n == len(rounds) {
			rounds = append(rounds, nil)
		}
		rounds[n] = append(rounds[n], k)
	}
	return rounds
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
// per op) and the same result as calling them one by one in order (with
// one Redis time for each script call): an op repeated within ops finds
// the earlier one's effect (AlreadySettled). They go out as one script call
// (settle.lua settles each in turn, atomically) per wire.MaxBatch ops, and
// on a Redis Cluster or Ring per hash slot too, as ReserveBatch's reserves.
// So Redis pays a call's fixed cost once per batch instead of once per op.
// A slot's calls go one round trip after another (see settleRounds). An
// invalid op fails alone; a failing connection fails every op of its call.
func (l *Limiter) SettleMany(ctx context.Context, ops []SettleOp) []SettleResult {
	out := make([]SettleResult, len(ops))
	groups := batches(l, len(ops), func(i int) uint16 { return wire.TenantSlot(ops[i].Tenant) }, nil, l.p.NewSettleBatch,
		func(b *wire.SettleBatch, i int) error {
			err := l.addSettle(b, &ops[i])
			out[i].Err = err
			return err
		})
	calls := groupCalls(groups)
	cmds := make([]*redis.Cmd, len(calls))
	for _, round := range settleRounds(groups) {
		part := make([]wire.Call, len(round))
		for j, k := range round {
			part[j] = calls[k]
		}
		for j, cmd := range l.run.RunAll(ctx, script.Settle, part) {
			cmds[round[j]] = cmd
		}
	}
	for k := range calls {
		if calls[k].Err != nil {
			continue
		}
		which := groups[k].which
		wire.DecodeSettles(cmds[k], &calls[k], func(j int, v wire.SettleReply, err error) {
			s, o := &ops[which[j]], &out[which[j]]
			if err != nil {
				if !errors.Is(err, ErrNoEpoch) {
					err = fmt.Errorf("settle %s/%s: %w", s.Tenant, s.User, err)
				}
				o.Err = err
				return
			}
			o.Settlement = settlement(v, calls[k].Batch[j])
		})
	}
	return out
}
