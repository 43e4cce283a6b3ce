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
	tenant, user           string
	version, tenantVersion int64
	limits                 []events.LimitState
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
// one transaction together with the alerts it queues. When it fails,
// nothing of the batch took effect (rate counters included), so the
// caller may handle the events again, one at a time.
func (d *Detector) HandleBatch(ctx context.Context, evs []events.Event) error {
	snaps := make([]snap, 0, len(evs))
	for _, ev := range evs {
		switch r := ev.Data.(type) {
		case events.Reserved:
			if !decidedLocally(r) {
				snaps = append(snaps, snap{ev.Time, r.Tenant, r.User, r.Version, r.TenantVersion, r.Limits})
			}
		case events.Corrected:
			snaps = append(snaps, snap{ev.Time, r.Tenant, r.User, r.Version, r.TenantVersion, r.Limits})
		}
	}
	if err := d.snapshots(ctx, snaps); err != nil {
		return err
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

// snapshots applies snapshots, in order, in one transaction: one query
// reads (and locks) the versions of their subjects, one the states of the
// limits that may change, one statement writes each back. A snapshot the
// level cache shows can change nothing (see quiet) only moves versions,
// unless a limit of it is moved by another snapshot of the batch.
func (d *Detector) snapshots(ctx context.Context, snaps []snap) error {
	// Which snapshots may change threshold state: those not quiet by the
	// cache, and those sharing a limit with one of them (their state may
	// change within the batch), to a fixed point.
	busy := make([]bool, len(snaps))
	touched := map[store.LimitKey]bool{}
	for i, s := range snaps {
		if len(s.limits) > 0 && !d.quiet(s.tenant, s.user, s.limits) {
			busy[i] = true
			for _, l := range s.limits {
				if k, ok := limitKey(s.tenant, s.user, l); ok {
					touched[k] = true
				}
			}
		}
	}
	for changed := true; changed; {
		changed = false
		for i, s := range snaps {
			if busy[i] {
				continue
			}
			for _, l := range s.limits {
				if k, ok := limitKey(s.tenant, s.user, l); ok && touched[k] {
					busy[i], changed = true, true
					break
				}
			}
			if busy[i] {
				for _, l := range s.limits {
					if k, ok := limitKey(s.tenant, s.user, l); ok {
						touched[k] = true
					}
				}
			}
		}
	}

	vkeys := map[store.VersionKey]bool{}
	for _, s := range snaps {
		if len(s.limits) == 0 {
			continue
		}
		vkeys[store.VersionKey{Tenant: s.tenant, User: s.user, Scope: "user"}] = true
		if s.tenantVersion > 0 {
			vkeys[store.VersionKey{Tenant: s.tenant, Scope: "tenant"}] = true
		}
	}
	if len(vkeys) == 0 {
		return nil
	}
	now := d.now()
	var fired int
	var levels map[store.LimitKey]int
	err := d.st.Update(ctx, func(tx *store.Tx) error {
		fired = 0
		levels = map[store.LimitKey]int{}
		cur, err := tx.Versions(ctx, slices.Collect(maps.Keys(vkeys)))
		if err != nil {
			return err
		}
		states, err := tx.Limits(ctx, slices.Collect(maps.Keys(touched)))
		if err != nil {
			return err
		}
		newVersions := map[store.VersionKey]int64{}
		newStates := map[store.LimitKey]store.LimitState{}
		// advance records v for k and reports whether the snapshot is
		// fresh (v at least the last version), as Tx.Advance does.
		advance := func(k store.VersionKey, v int64) bool {
			last, ok := cur[k]
			if ok && last > v {
				return false
			}
			cur[k] = v
			if !ok || last < v {
				newVersions[k] = v
			}
			return true
		}
		for i, s := range snaps {
			if len(s.limits) == 0 {
				continue
			}
			if !busy[i] {
				// Quiet: only the versions move (never back).
				if s.version > 0 {
					advance(store.VersionKey{Tenant: s.tenant, User: s.user, Scope: "user"}, s.version)
				}
				if s.tenantVersion > 0 {
					advance(store.VersionKey{Tenant: s.tenant, Scope: "tenant"}, s.tenantVersion)
				}
				continue
			}
			userFresh := advance(store.VersionKey{Tenant: s.tenant, User: s.user, Scope: "user"}, s.version)
			tenantFresh := true // unordered when the tenant's version is unknown
			if s.tenantVersion > 0 {
				tenantFresh = advance(store.VersionKey{Tenant: s.tenant, Scope: "tenant"}, s.tenantVersion)
			}
			for _, l := range s.limits {
				k, ok := limitKey(s.tenant, s.user, l)
				if !ok || (l.Scope == "user" && !userFresh) || (l.Scope == "tenant" && !tenantFresh) {
					continue // stale, or a global or IP limit: not a tenant's quota
				}
				var resetAt time.Time
				if l.ResetSeconds > 0 {
					resetAt = s.at.Add(time.Duration(l.ResetSeconds) * time.Second)
				}
				st := states[k]
				prev := st.Fires
				st, crossed := step(st, l.Used, l.Limit, s.at, resetAt, d.opt.Hysteresis)
				states[k], newStates[k] = st, st
				levels[k] = st.Level
				for j, t := range crossed {
					data := ThresholdData{
						Tenant: s.tenant, User: k.User, Scope: l.Scope, Endpoint: l.Endpoint, LimitName: l.Name,
						Unit: l.Unit, Threshold: t, Used: l.Used, Limit: l.Limit,
						Percent: min(percent(l.Used, l.Limit), 100), ResetSeconds: l.ResetSeconds, OccurredAt: s.at,
					}
					if err := d.enqueue(ctx, tx, thresholdAlert(k, t, prev+int64(j)+1), now, data); err != nil {
						return err
					}
					fired++
				}
			}
		}
		if err := tx.SaveLimits(ctx, newStates); err != nil {
			return err
		}
		return tx.SaveVersions(ctx, newVersions)
	})
	if err != nil {
		err = fmt.Errorf("thresholds of a batch of %d snapshots: %w", len(snaps), err)
	}
	return d.committed(err, levels, fired)
}
