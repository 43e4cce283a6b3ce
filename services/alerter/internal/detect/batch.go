package detect

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"time"

	"quotaflow/pkg/events"
	"quotaflow/services/alerter/internal/store"
)

// snap is one limits snapshot of a reserved or corrected event.
type snap struct {
	at                     time.Time
	tenant, user, plan     string // plan: "" when the event names none
	version, tenantVersion int64
	limits                 []events.LimitState
}

// resetAt is when l, in a snapshot taken at at, frees capacity or resets;
// zero when the snapshot does not say.
func resetAt(at time.Time, l events.LimitState) time.Time {
	if l.ResetSeconds <= 0 {
		return time.Time{}
	}
	return at.Add(time.Duration(l.ResetSeconds) * time.Second)
}

// limitKey returns the state key of l in a snapshot of (tenant, user), and
// false for a limit that is not a tenant's quota (global, IP).
func limitKey(tenant, user string, l events.LimitState) (store.LimitKey, bool) {
	k := store.LimitKey{Tenant: tenant, Scope: l.Scope, Endpoint: l.Endpoint, Name: l.Name}
	switch l.Scope {
	case "user":
		k.User = user
	case "tenant":
	default:
		return k, false
	}
	return k, true
}

// HandleBatch handles a batch of events as their methods would one by one
// (Reserved, Corrected, Denied; other events are ignored), in order, with
// the threshold state of all their snapshots read, moved and written in
// one transaction together with the alerts it queues; when every snapshot
// is quiet, their versions are only held in memory, for Flush (or the next
// transaction) to write. When it fails, nothing of the batch took effect
// (rate counters included), so the caller may handle the events again, one
// at a time.
func (d *Detector) HandleBatch(ctx context.Context, evs []events.Event) error {
	snaps := make([]snap, 0, len(evs))
	for _, ev := range evs {
		switch r := ev.Data.(type) {
		case events.Reserved:
			if !decidedLocally(r) && len(r.Limits) > 0 {
				snaps = append(snaps, snap{ev.Time, r.Tenant, r.User, r.Plan, r.Version, r.TenantVersion, r.Limits})
			}
		case events.Corrected:
			if len(r.Limits) > 0 {
				snaps = append(snaps, snap{ev.Time, r.Tenant, r.User, r.Plan, r.Version, r.TenantVersion, r.Limits})
			}
		}
	}
	if err := d.snapshots(ctx, snaps); err != nil {
		return err
	}
	for _, s := range snaps {
		d.top.add(s.tenant, s.at, s.tenantVersion, s.limits)
	}
	for _, ev := range evs {
		switch r := ev.Data.(type) {
		case events.Reserved:
			d.count(ev, r.Tenant, r.Endpoint, 1, 0, nil)
		case events.Denied:
			_ = d.Denied(ctx, ev, r)
		}
	}
	return nil
}

// snapshots applies snapshots (each with limits), in order. The busy ones
// (see busy) are applied in one transaction: one query reads (and locks)
// the versions of their subjects, one the states of the limits they
// touch, one statement writes back the states that changed, one the
// versions, the held ones included. The quiet ones only move their
// subjects' versions (never back), which needs no read: when all are
// quiet, they are held for Flush.
func (d *Detector) snapshots(ctx context.Context, snaps []snap) error {
	if len(snaps) == 0 {
		return nil
	}
	busy, touched := d.busy(snaps)
	userKey := func(s snap) store.VersionKey { return store.VersionKey{Tenant: s.tenant, User: s.user, Scope: "user"} }
	tenantKey := func(s snap) store.VersionKey { return store.VersionKey{Tenant: s.tenant, Scope: "tenant"} }
	// newVersions is every subject's highest version in the batch, the
	// last-seen versions read or not: written back, it moves none back.
	newVersions := map[store.VersionKey]int64{}
	raise := func(k store.VersionKey, v int64) {
		if v > 0 && v > newVersions[k] {
			newVersions[k] = v
		}
	}
	var read []store.VersionKey // the versions busy snapshots are ordered by
	for i, s := range snaps {
		raise(userKey(s), s.version)
		raise(tenantKey(s), s.tenantVersion)
		if busy[i] {
			read = append(read, userKey(s))
			if s.tenantVersion > 0 {
				read = append(read, tenantKey(s))
			}
		}
	}
	if len(touched) == 0 {
		d.hold(newVersions)
		return nil
	}
	// The transaction writes the held versions too: one statement, and
	// busy snapshots are ordered against every version seen.
	held := d.heldVersions()
	for k, v := range held {
		if v > newVersions[k] {
			newVersions[k] = v
		}
	}
	now := d.now()
	var fired int
	var levels map[store.LimitKey]int
	// The first statement locks every version the transaction writes, not
	// only those it orders busy snapshots by: locking the others at the
	// save, after the limits, two alerters (a subject busy in one's batch
	// and quiet in the other's) waited on each other.
	lock := slices.AppendSeq(slices.Clip(read), maps.Keys(newVersions))
	err := d.st.Update(ctx, func(tx *store.Tx) error {
		fired = 0
		levels = map[store.LimitKey]int{}
		cur, err := tx.Versions(ctx, lock)
		if err != nil {
			return err
		}
		for _, k := range read {
			if v, ok := held[k]; ok && v > cur[k] {
				cur[k] = v
			}
		}
		stored, err := tx.Limits(ctx, slices.Collect(maps.Keys(touched)))
		if err != nil {
			return err
		}
		states := maps.Clone(stored)
		// advance records v for k and reports whether the snapshot is
		// fresh (v at least the last version seen), in batch order.
		advance := func(k store.VersionKey, v int64) bool {
			last, ok := cur[k]
			if ok && last > v {
				return false
			}
			cur[k] = v
			return true
		}
		for i, s := range snaps {
			if !busy[i] {
				// Quiet: only the versions move (never back).
				if s.version > 0 {
					advance(userKey(s), s.version)
				}
				if s.tenantVersion > 0 {
					advance(tenantKey(s), s.tenantVersion)
				}
				continue
			}
			userFresh := advance(userKey(s), s.version)
			tenantFresh := true // unordered when the tenant's version is unknown
			if s.tenantVersion > 0 {
				tenantFresh = advance(tenantKey(s), s.tenantVersion)
			}
			for _, l := range s.limits {
				k, ok := limitKey(s.tenant, s.user, l)
				if !ok || (l.Scope == "user" && !userFresh) || (l.Scope == "tenant" && !tenantFresh) {
					continue // stale, or a global or IP limit: not a tenant's quota
				}
				st := states[k]
				prev := st.Fires
				r := d.rule(s.tenant, s.plan, l)
				st, crossed := step(st, l.Used, l.Limit, s.at, resetAt(s.at, l), r.thresholds, r.resets, d.opt.Hysteresis)
				states[k] = st
				for j, t := range crossed {
					data := ThresholdData{
						Tenant: s.tenant, User: k.User, Scope: l.Scope, Endpoint: l.Endpoint, LimitName: l.Name,
						Unit: l.Unit, Threshold: t, Used: l.Used, Limit: l.Limit,
						Percent: min(percent(l.Used, l.Limit), 100), ResetSeconds: l.ResetSeconds, OccurredAt: s.at,
					}
					if err := d.enqueue(ctx, tx, thresholdAlert(k, t, prev+int64(j)+1), t, now, data); err != nil {
						return err
					}
					fired++
				}
			}
		}
		changed := map[store.LimitKey]store.LimitState{}
		for k := range touched {
			levels[k] = states[k].Level
			if !equivalent(stored[k], states[k]) {
				changed[k] = states[k]
			}
		}
		if err := tx.SaveLimits(ctx, changed); err != nil {
			return err
		}
		return tx.SaveVersions(ctx, newVersions)
	})
	if err != nil {
		err = fmt.Errorf("thresholds of a batch of %d snapshots: %w", len(snaps), err)
	} else {
		d.written(newVersions)
	}
	return d.committed(err, touched, levels, fired)
}

// busy returns which snapshots may change threshold state, and the limits
// they touch: those not quiet, and those sharing a limit with one of them
// (its state may change within the batch), to a fixed point.
func (d *Detector) busy(snaps []snap) ([]bool, map[store.LimitKey]bool) {
	busy := make([]bool, len(snaps))
	touched := map[store.LimitKey]bool{}
	touch := func(s snap) {
		for _, l := range s.limits {
			if k, ok := limitKey(s.tenant, s.user, l); ok {
				touched[k] = true
			}
		}
	}
	for i, s := range snaps {
		if !d.quiet(s) {
			busy[i] = true
			touch(s)
		}
	}
	for changed := len(touched) > 0; changed; {
		changed = false
		for i, s := range snaps {
			if busy[i] {
				continue
			}
			for _, l := range s.limits {
				if k, ok := limitKey(s.tenant, s.user, l); ok && touched[k] {
					busy[i], changed = true, true
					touch(s)
					break
				}
			}
		}
	}
	return busy, touched
}

// equivalent reports whether two states of a limit behave alike: the same
// level and firings, and at a level above 0 the same last usage and reset
// time (step reads those only then). A state equivalent to the stored one
// (absent: the zero state) is not written, so a limit that never fired
// has no row.
func equivalent(a, b store.LimitState) bool {
	if a.Level != b.Level || a.Fires != b.Fires {
		return false
	}
	return a.Level == 0 || a.LastUsed == b.LastUsed && a.ResetAt.Equal(b.ResetAt)
}
