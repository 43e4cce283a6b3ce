package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"quotaflow/internal/e2e"
)

// slotMasters is CLUSTER SLOTS as the node at addr sees it: each slot
// range with its master first.
func slotMasters(ctx context.Context, addr string) ([]redis.ClusterSlot, error) {
	c := redis.NewClient(&redis.Options{Addr: addr})
	defer c.Close()
	return c.ClusterSlots(ctx).Result()
}

// masterOf is the address of the master serving slot; "" if none.
func masterOf(slots []redis.ClusterSlot, slot int64) string {
	for _, s := range slots {
		if int64(s.Start) <= slot && slot <= int64(s.End) && len(s.Nodes) > 0 {
			return s.Nodes[0].Addr
		}
	}
	return ""
}

// keySlot is the cluster slot of key, as the node at addr computes it.
func keySlot(ctx context.Context, addr, key string) (int64, error) {
	c := redis.NewClient(&redis.Options{Addr: addr})
	defer c.Close()
	return c.ClusterKeySlot(ctx, key).Result()
}

// tenantKey is a key carrying tenant's hash tag (pkg/limits keys are
// q{T}...; the run's tenant names need no escaping).
func tenantKey(tenant string) string { return "q{" + tenant + "}t" }

// tenantsSpread checks, before the load starts, that the run's tenants'
// hash tags land on every master, so that a master killed is some
// tenants' and the traffic crosses every shard.
func (st *stack) tenantsSpread(ctx context.Context, cfg Config) (string, error) {
	seed := st.RedisNodes[0].Addr
	slots, err := slotMasters(ctx, seed)
	if err != nil {
		return "", err
	}
	per := map[string][]string{}
	for _, t := range cfg.tenants() {
		slot, err := keySlot(ctx, seed, tenantKey(t))
		if err != nil {
			return "", err
		}
		m := masterOf(slots, slot)
		per[m] = append(per[m], t)
	}
	masters := map[string]bool{}
	for _, s := range slots {
		masters[s.Nodes[0].Addr] = true
	}
	var parts []string
	for m := range masters {
		parts = append(parts, fmt.Sprintf("%s: %s", m, strings.Join(per[m], " ")))
	}
	detail := fmt.Sprintf("%d tenants over %d masters (%s)", len(cfg.tenants()), len(masters), strings.Join(parts, "; "))
	for m := range masters {
		if len(per[m]) == 0 {
			return "", fmt.Errorf("no tenant on master %s: %s", m, detail)
		}
	}
	return detail, nil
}

// failover kills the master of the first tenant's slot, waits until a
// replica serves that slot and every node says cluster_state:ok, keeps
// the old master down for the rest of down and starts it again (it
// rejoins as the new master's replica).
func (st *stack) failover(ctx context.Context, down time.Duration) error {
	tenant := tenantKey(st.cfg.tenants()[0])
	seed := st.RedisNodes[0]
	slot, err := keySlot(ctx, seed.Addr, tenant)
	if err != nil {
		return err
	}
	slots, err := slotMasters(ctx, seed.Addr)
	if err != nil {
		return err
	}
	var killed, other *e2e.Server
	for _, n := range st.RedisNodes {
		if n.Addr == masterOf(slots, slot) {
			killed = n
		} else if other == nil {
			other = n
		}
	}
	if killed == nil {
		return fmt.Errorf("no node masters slot %d", slot)
	}
	// The tenants whose keys the killed master holds.
	tenants := map[string]bool{}
	for _, t := range st.cfg.tenants() {
		if s, err := keySlot(ctx, seed.Addr, tenantKey(t)); err == nil && masterOf(slots, s) == killed.Addr {
			tenants[t] = true
		}
	}
	t0 := time.Now()
	killed.Kill()
	promoted := ""
	for {
		s, err := slotMasters(ctx, other.Addr)
		if m := masterOf(s, slot); err == nil && m != "" && m != killed.Addr {
			promoted = m
			break
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("no replica took over slot %d: %w", slot, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
	c := redis.NewClient(&redis.Options{Addr: other.Addr})
	err = e2e.WaitClusterOK(ctx, c)
	c.Close()
	if err != nil {
		return err
	}
	st.failoverTook = time.Since(t0)
	if st.loss, err = st.allows.lostReserves(ctx, promoted, tenants, t0); err != nil {
		return fmt.Errorf("reserves on the promoted replica: %w", err)
	}
	fmt.Fprintf(st.out, "[%s] redis master %s: replica %s serves its slots after %.1fs; it lacks %d of the %d reserves acknowledged before the kill\n",
		time.Now().Format("15:04:05"), killed.Addr, promoted, st.failoverTook.Seconds(), st.loss.lost, st.loss.checked)
	select {
	case <-ctx.Done():
	case <-time.After(down - time.Since(t0)):
	}
	return killed.Up(ctx)
}

// tenantKeysOneSlot checks what the run left on the masters: every
// tenant's keys lie in one slot (so every script of a tenant runs on one
// shard), and the tenants' keys are on every master.
func (st *stack) tenantKeysOneSlot(ctx context.Context) (bool, string) {
	slotsOf := map[string]map[int64]bool{}
	keys, masters, holding := 0, 0, 0
	for _, n := range st.RedisNodes {
		c := redis.NewClient(&redis.Options{Addr: n.Addr})
		role, err := c.Do(ctx, "ROLE").Slice()
		if err != nil || fmt.Sprint(role[0]) != "master" {
			c.Close()
			continue
		}
		masters++
		var ks []string
		iter := c.Scan(ctx, 0, "q{*", 1000).Iterator()
		for iter.Next(ctx) {
			if k := iter.Val(); !strings.HasPrefix(k, "q{%") { // not a shared scope's
				ks = append(ks, k)
			}
		}
		if err := iter.Err(); err != nil {
			c.Close()
			return false, err.Error()
		}
		cmds, err := c.Pipelined(ctx, func(p redis.Pipeliner) error {
			for _, k := range ks {
				p.ClusterKeySlot(ctx, k)
			}
			return nil
		})
		c.Close()
		if err != nil {
			return false, err.Error()
		}
		if len(ks) > 0 {
			holding++
		}
		for i, k := range ks {
			tenant := k[2:strings.IndexByte(k, '}')]
			if slotsOf[tenant] == nil {
				slotsOf[tenant] = map[int64]bool{}
			}
			slotsOf[tenant][cmds[i].(*redis.IntCmd).Val()] = true
			keys++
		}
	}
	var spread []string
	for t, ss := range slotsOf {
		if len(ss) != 1 {
			spread = append(spread, fmt.Sprintf("%s over %d slots", t, len(ss)))
		}
	}
	ok := len(spread) == 0 && masters == 3 && holding == masters && len(slotsOf) == len(st.cfg.tenants())
	return ok, fmt.Sprintf("%d keys of %d tenants on %d of %d masters; tenants over more than one slot: %v",
		keys, len(slotsOf), holding, masters, spread)
}

// allowLog is every allowed admit of a cluster run, with when its answer
// came, to find the reserves a failover lost.
type allowLog struct {
	mu     sync.Mutex
	allows []allowed
}

type allowed struct {
	tenant, user, id string
	estimate         int64
	by               string // the admission URL that answered
	at               time.Time
}

func (l *allowLog) add(u e2e.User, id string, estimate int64, by string) {
	l.mu.Lock()
	l.allows = append(l.allows, allowed{u.Tenant, u.Name, id, estimate, by, time.Now()})
	l.mu.Unlock()
}

// outboxWindow bounds how long before an admission instance's SIGKILL an
// admit it answered can have its reserved event still in the instance's
// memory queue, lost with it (README, "When something fails"): a batch
// wait and a JetStream round trip, on a loaded host.
const outboxWindow = time.Second

// queuedAtKill returns the request ids of the admits the admission
// instance at api answered within outboxWindow before killed.
func (l *allowLog) queuedAtKill(api string, killed time.Time) map[string]bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	ids := map[string]bool{}
	for _, a := range l.allows {
		if a.by == api && !a.at.After(killed) && killed.Sub(a.at) <= outboxWindow {
			ids[a.id] = true
		}
	}
	return ids
}

// reservedMissing returns the allowed admits whose reserved event the
// ledger lacks.
func (l *allowLog) reservedMissing(ctx context.Context, dbURL string) ([]string, error) {
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return nil, err
	}
	defer conn.Close(ctx)
	// A reserved event is the reservation's estimate (e2e.ReadLedger).
	rows, err := conn.Query(ctx, `SELECT request_id FROM reservations WHERE estimated_tokens IS NOT NULL`)
	if err != nil {
		return nil, err
	}
	have := map[string]bool{}
	var id string
	if _, err := pgx.ForEachRow(rows, []any{&id}, func() error {
		have[id] = true
		return nil
	}); err != nil {
		return nil, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	var missing []string
	for _, a := range l.allows {
		if !have[a.id] {
			missing = append(missing, a.id)
		}
	}
	return missing, nil
}

// replicationWindow bounds how long before a master's death a reserve it
// acknowledged can be missing on the replica that takes over: Redis
// streams every write to its replicas as it applies it, asynchronously,
// so only what was still in the master's output buffer is lost (README,
// "When something fails"; docs/design.md §9).
const replicationWindow = time.Second

// replicationLoss is what the failover lost: reserves the killed master
// had acknowledged (their admits answered 200 before the kill) that the
// promoted replica does not hold.
type replicationLoss struct {
	checked, lost int
	lostTokens    int64
	oldest        time.Duration // the earliest lost reserve's answer, before the kill
}

// lostReserves looks up, on the promoted master at addr, the reservation
// record (q{T}r:U:R, pkg/limits keys) of every admit of tenants answered
// before killedAt.
func (l *allowLog) lostReserves(ctx context.Context, addr string, tenants map[string]bool, killedAt time.Time) (replicationLoss, error) {
	l.mu.Lock()
	var before []allowed
	for _, a := range l.allows {
		if tenants[a.tenant] && a.at.Before(killedAt) {
			before = append(before, a)
		}
	}
	l.mu.Unlock()
	c := redis.NewClient(&redis.Options{Addr: addr})
	defer c.Close()
	cmds, err := c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for _, a := range before {
			p.Exists(ctx, "q{"+a.tenant+"}r:"+a.user+":"+a.id)
		}
		return nil
	})
	if err != nil {
		return replicationLoss{}, err
	}
	loss := replicationLoss{checked: len(before)}
	for i, a := range before {
		if cmds[i].(*redis.IntCmd).Val() == 0 {
			loss.lost++
			loss.lostTokens += a.estimate
			loss.oldest = max(loss.oldest, killedAt.Sub(a.at))
		}
	}
	return loss, nil
}
