package limits

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"quotaflow/pkg/limits/internal/wire"
	"quotaflow/pkg/limits/policy"
)

// Counted reports whether Reserve and Peek may keep rules in counters
// rather than in the subject's blob, which they do for a Request that sets
// Counted: when every rule is a fixed window of requests (so none keeps a
// record, KeepsRecord). Each such limit of a
// subject is then a key of its own, as CountBatch's counters are ('<i6i6'
// window number and count, count.lua; the user's q{T}c:U:N, the tenant's
// q{T}C:N, on the tenant's hash tag), which a reserve checks and charges
// at a fraction of the blob engine's cost in Redis. No version is stored:
// such a Decision's Version (and TenantVersion, with a tenant-wide rule)
// is its call's Redis time in µs plus its place among the call's reserves,
// which grows from one decision of a subject to the next as long as
// Redis's clock does not step back and a call spends at least 1 µs per
// reserve (it spends several); in µs, as the blobs' versions, so a plan
// that changes shape keeps its snapshots in order. The two stores never
// share a count: a window stays in one store as long as the policy does,
// since every request over it sets Counted alike (policy.Resolved.Counted);
// a policy that changes shape (a token limit added anywhere a tenant's
// requests can reach, or the last one removed) moves the tenant's request
// windows to the other store, where they go on from what that store holds
// in the current window, mostly nothing (docs/design.md §4).
func Counted(rules []policy.Rule) bool {
	for i := range rules {
		if r := &rules[i]; r.Kind != policy.Fixed || r.Unit != policy.Requests {
			return false
		}
	}
	return len(rules) > 0
}

// counted reports whether r is kept in counters.
func (r *Request) counted() bool { return r.Counted && Counted(r.Rules) }

// reserve makes the reserve (or peek) calls of rs in mode, batched as
// ReserveBatch says: the counted ones as count calls, the others in the
// subjects' blobs, in one round trip each, at the same time.
func (l *Limiter) reserve(ctx context.Context, rs []Request, mode int) []Reserved {
	n := 0
	for i := range rs {
		if rs[i].counted() {
			n++
		}
	}
	switch n {
	case 0:
		return l.reserveBlobs(ctx, rs, mode)
	case len(rs):
		return l.reserveCounts(ctx, rs, mode == wire.ModePeek)
	}
	var counts, blobs []Request
	var at []bool // whether rs[i] is counted
	for i := range rs {
		c := rs[i].counted()
		at = append(at, c)
		if c {
			counts = append(counts, rs[i])
		} else {
			blobs = append(blobs, rs[i])
		}
	}
	var co []Reserved
	var wg sync.WaitGroup
	wg.Go(func() { co = l.reserveCounts(ctx, counts, mode == wire.ModePeek) })
	bo := l.reserveBlobs(ctx, blobs, mode)
	wg.Wait()
	out := make([]Reserved, 0, len(rs))
	for _, c := range at {
		if c {
			out, co = append(out, co[0]), co[1:]
		} else {
			out, bo = append(out, bo[0]), bo[1:]
		}
	}
	return out
}

// reserveCounts reserves (or, peek, reads) rs, which are counted,
// each request one CountBatch group of its subject's counters: charged 1
// each, all or none.
func (l *Limiter) reserveCounts(ctx context.Context, rs []Request, peek bool) []Reserved {
	out := make([]Reserved, len(rs))
	parts := make([]countPart, 0, len(rs))
	cost := int64(1)
	if peek {
		cost = 0
	}
	for i := range rs {
		r := &rs[i]
		if err := wire.CheckSubjectCall(r.Tenant, r.User, r.RequestID, r.Cost); err != nil {
			out[i].Err = err
			continue
		}
		cs := make([]wire.Counter, len(r.Rules))
		for j := range r.Rules {
			cs[j] = wire.Counter{Scope: r.Rules[j].Scope, Tenant: r.Tenant, ID: r.User, Cost: cost, Rule: &r.Rules[j]}
			if err := wire.CheckCounter(&cs[j]); err != nil {
				out[i].Err = fmt.Errorf("reserve %s/%s: %w", r.Tenant, r.User, err)
				break
			}
		}
		if out[i].Err == nil {
			parts = append(parts, countPart{group: i, slot: wire.TenantSlot(r.Tenant), counters: cs})
		}
	}
	done := l.runCounts(ctx, parts)
	for k := range parts {
		p := &parts[k]
		o := &out[p.group]
		if err := done[k].err; err != nil {
			if !errors.Is(err, ErrNoEpoch) {
				r := &rs[p.group]
				err = fmt.Errorf("reserve %s/%s: %w", r.Tenant, r.User, err)
			}
			o.Err = err
			continue
		}
		d := &o.Decision
		d.Allowed, d.DeniedBy, d.States = done[k].Status == wire.StatusAllowed, -1, make([]State, len(p.counters))
		d.count(p, &done[k])
		d.Version = d.Now.UnixMicro() + int64(done[k].place)
		for _, c := range p.counters {
			if c.Scope == policy.ScopeTenant {
				d.TenantVersion = d.Version
			}
		}
	}
	return out
}
