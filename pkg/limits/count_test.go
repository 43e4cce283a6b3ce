package limits_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/internal/limitstest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/internal/wire"
	"quotaflow/pkg/limits/policy"
	"quotaflow/pkg/limits/repair"
)

// countRules are the fixed windows the count tests draw from: token and
// request units, a shadow one, and a limit of 0.
func countRules() []policy.Rule {
	fixed := func(name string, unit policy.Unit, limit int64, w time.Duration, shadow bool) policy.Rule {
		return policy.Rule{Limit: policy.Limit{Name: name, Kind: policy.Fixed, Unit: unit, Limit: limit, Window: policy.Duration(w), Shadow: shadow},
			Scope: policy.ScopeGlobal, Endpoint: "e"}
	}
	return []policy.Rule{
		fixed("hour", policy.Tokens, 40, time.Hour, false),
		fixed("day", policy.Tokens, 90, 24*time.Hour, false),
		fixed("reqs", policy.Requests, 12, time.Hour, false),
		fixed("shadow", policy.Tokens, 15, time.Hour, true),
		fixed("zero", policy.Tokens, 0, time.Hour, false),
	}
}

// countModel is what CountBatch promises, for counters that stay in one
// window: a group charges each of its counters (cost, or 1 for requests)
// when every non-shadow one fits after the group's earlier ones, else
// nothing.
type countModel map[string]int64

func (m countModel) group(reqs []limits.SharedRequest) (allowed bool, seen []int64) {
	tentative := map[string]int64{}
	allowed = true
	for _, r := range reqs {
		for j := range r.Rules {
			rule := &r.Rules[j]
			k := string(r.Scope) + " " + r.ID + " " + rule.Name
			cost := r.Cost
			if rule.Unit != policy.Tokens {
				cost = 1
			}
			used := m[k] + tentative[k]
			seen = append(seen, used)
			if used+cost > rule.Limit.Limit && !rule.Shadow {
				allowed = false
				continue
			}
			tentative[k] += cost
		}
	}
	if allowed {
		for k, v := range tentative {
			m[k] += v
		}
	}
	return allowed, seen
}

// TestCountBatchAgreesWithModel sends random batches of random groups
// (repeated counters, shadow and zero limits, costs past the limits) and
// checks every group's decision and states against countModel, and what
// Redis holds at the end, on one node and on a cluster, where a group's
// counters span slots and a denied slot's part makes the others give
// back (there one group per call: the groups after it in a call would see
// its charge before the give back). QF_MODEL_SEED replays a run.
func TestCountBatchAgreesWithModel(t *testing.T) {
	for _, tc := range []struct {
		name   string
		client func(t *testing.T) limits.Client
	}{
		{"node", func(t *testing.T) limits.Client { return redistest.Shared(t) }},
		{"cluster", func(t *testing.T) limits.Client {
			cc := redistest.Cluster(t)
			if err := repair.WriteEpoch(context.Background(), cc, "count"); err != nil {
				t.Fatal(err)
			}
			return cc
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := tc.client(t)
			ctx := context.Background()
			seed := uint64(time.Now().UnixNano())
			if s := os.Getenv("QF_MODEL_SEED"); s != "" {
				seed, _ = strconv.ParseUint(s, 10, 64)
			}
			t.Logf("QF_MODEL_SEED=%d", seed)
			rng := rand.New(rand.NewPCG(seed, 11))
			// Five minutes into the hour: no window turns over during the run.
			offset := 5*time.Minute - time.Duration(time.Now().UnixNano()%int64(time.Hour))
			l := limits.New(c, limits.Options{NoEpochGuard: tc.name == "node", ClockOffset: offset})
			rules := countRules()
			ids := []string{redistest.UniqueName(t) + "a", redistest.UniqueName(t) + "b", redistest.UniqueName(t) + "c"}
			m := countModel{}
			allowed, denied := 0, 0
			for range 300 {
				groups := make([][]limits.SharedRequest, 1+rng.IntN(5))
				if tc.name == "cluster" {
					groups = groups[:1]
				}
				for g := range groups {
					for range 1 + rng.IntN(4) {
						r := rules[rng.IntN(len(rules))]
						groups[g] = append(groups[g], limits.SharedRequest{Scope: policy.ScopeGlobal, ID: ids[rng.IntN(len(ids))],
							Cost: int64(rng.IntN(9)), Rules: []policy.Rule{r}})
					}
				}
				out := l.CountBatch(ctx, groups)
				for g, reqs := range groups {
					o := out[g]
					if o.Err != nil {
						t.Fatalf("CountBatch group %d error = %v", g, o.Err)
					}
					ok, seen := m.group(reqs)
					if o.Decision.Allowed != ok {
						t.Fatalf("CountBatch group %d %+v allowed = %v, want %v (seen %v)", g, reqs, o.Decision.Allowed, ok, seen)
					}
					if ok {
						allowed++
					} else {
						denied++
					}
					if len(o.Decision.States) != len(seen) {
						t.Fatalf("CountBatch group %d: %d states, want %d", g, len(o.Decision.States), len(seen))
					}
					firstDenied := -1
					for i, s := range o.Decision.States {
						r := &reqs[i]
						cost := r.Cost
						if r.Rules[0].Unit != policy.Tokens {
							cost = 1
						}
						want := seen[i]
						if ok {
							want += cost
						}
						fits := seen[i]+cost <= r.Rules[0].Limit.Limit
						if s.Used != want || s.Limit != r.Rules[0].Limit.Limit || s.Remaining != max(0, s.Limit-s.Used) || s.WouldDeny != (!fits && r.Rules[0].Shadow) {
							t.Fatalf("CountBatch group %d state %d (%s cost %d, seen %d) = %+v, want used %d", g, i, r.Rules[0].Name, cost, seen[i], s, want)
						}
						if s.Reset <= 0 || s.Reset > time.Duration(r.Rules[0].Window) {
							t.Fatalf("CountBatch group %d state %d reset = %v", g, i, s.Reset)
						}
						if !fits && !r.Rules[0].Shadow && firstDenied < 0 {
							firstDenied = i
						}
					}
					if o.Decision.DeniedBy != firstDenied {
						t.Fatalf("CountBatch group %d DeniedBy = %d, want %d", g, o.Decision.DeniedBy, firstDenied)
					}
				}
			}
			// What Redis holds: a check of no cost sees each counter's count.
			for _, id := range ids {
				for _, r := range rules {
					out := l.CountBatch(ctx, [][]limits.SharedRequest{{{Scope: policy.ScopeGlobal, ID: id, Rules: []policy.Rule{r}}}})
					if out[0].Err != nil {
						t.Fatal(out[0].Err)
					}
					if got, want := out[0].Decision.States[0].Used, m[string(policy.ScopeGlobal)+" "+id+" "+r.Name]; r.Unit == policy.Tokens && got != want {
						t.Errorf("counter %s %s holds %d, want %d", id, r.Name, got, want)
					}
				}
			}
			t.Logf("%d groups allowed, %d denied", allowed, denied)
			if allowed < 50 || denied < 50 {
				t.Fatalf("%d groups allowed, %d denied: the run covered too little of either", allowed, denied)
			}
		})
	}
}

// TestCountBatchIsExactUnderConcurrency races single-counter groups of many
// goroutines, each its own CountBatch call, against one limit: exactly the
// limit is allowed.
func TestCountBatchIsExactUnderConcurrency(t *testing.T) {
	c := redistest.Shared(t)
	l := limitstest.At(c, 0)
	r := policy.Rule{Limit: policy.Limit{Name: "day", Kind: policy.Fixed, Unit: policy.Tokens, Limit: 1000, Window: policy.Duration(24 * time.Hour)}, Scope: policy.ScopeGlobal}
	// Not at a window's edge: a day's window turning over would reset it.
	if time.Until(time.Now().Truncate(24*time.Hour).Add(24*time.Hour)) < time.Minute {
		t.Skip("within a minute of the day's window end")
	}
	id := redistest.UniqueName(t)
	var ok atomic.Int64
	var wg sync.WaitGroup
	for range 32 {
		wg.Go(func() {
			for range 100 {
				out := l.CountBatch(context.Background(), [][]limits.SharedRequest{{{Scope: policy.ScopeGlobal, ID: id, Cost: 1, Rules: []policy.Rule{r}}}})
				if out[0].Err != nil {
					t.Error(out[0].Err)
					return
				}
				if out[0].Decision.Allowed {
					ok.Add(1)
				}
			}
		})
	}
	wg.Wait()
	if ok.Load() != 1000 {
		t.Fatalf("allowed %d of 3200 racing groups, want exactly 1000", ok.Load())
	}
}

// TestCountBatchWindowsAndKeys moves through fixed windows (a new window
// counts from zero), and checks that a counter is one small key that
// expires with its window, apart from the scope's blob.
func TestCountBatchWindowsAndKeys(t *testing.T) {
	c := redistest.Shared(t)
	ctx := context.Background()
	base := -time.Duration(time.Now().UnixNano() % int64(time.Minute)) // Redis time at a minute's start
	r := policy.Rule{Limit: policy.Limit{Name: "m", Kind: policy.Fixed, Unit: policy.Tokens, Limit: 10, Window: policy.Duration(time.Minute)}, Scope: policy.ScopeIP}
	id := "10.0.0." + strconv.Itoa(rand.IntN(250)) + redistest.UniqueName(t)
	group := func(cost int64) [][]limits.SharedRequest {
		return [][]limits.SharedRequest{{{Scope: policy.ScopeIP, ID: id, Cost: cost, Rules: []policy.Rule{r}}}}
	}
	for _, step := range []struct {
		at          time.Duration
		cost        int64
		allowed     bool
		used, reset int64 // reset in seconds
	}{
		{at: 10 * time.Second, cost: 7, allowed: true, used: 7, reset: 50},
		{at: 20 * time.Second, cost: 4, allowed: false, used: 7, reset: 40},
		{at: 30 * time.Second, cost: 3, allowed: true, used: 10, reset: 30},
		{at: 70 * time.Second, cost: 4, allowed: true, used: 4, reset: 50}, // the next window
		{at: 80 * time.Second, cost: 11, allowed: false, used: 4, reset: 40},
	} {
		out := limitstest.At(c, base+step.at).CountBatch(ctx, group(step.cost))
		d, err := out[0].Decision, out[0].Err
		if err != nil || d.Allowed != step.allowed || d.States[0].Used != step.used || d.States[0].Reset.Round(time.Second) != time.Duration(step.reset)*time.Second {
			t.Fatalf("CountBatch at %v cost %d = %+v, %v; want allowed %v, used %d, reset %ds", step.at, step.cost, d, err, step.allowed, step.used, step.reset)
		}
		if step.cost == 11 && (d.Reason != limits.ReasonCostExceedsLimit || d.RetryAfter != 0) {
			t.Errorf("a cost past the limit: reason %q retry %v, want cost_exceeds_limit and 0", d.Reason, d.RetryAfter)
		}
		if step.cost == 4 && !step.allowed && d.RetryAfter.Round(time.Second) != 40*time.Second {
			t.Errorf("retry after = %v, want 40s", d.RetryAfter)
		}
	}
	keys, err := c.Keys(ctx, "q{%i"+id+"}*").Result()
	if err != nil || len(keys) != 1 {
		t.Fatalf("keys of the counter = %v, %v; want one", keys, err)
	}
	if n, _ := c.StrLen(ctx, keys[0]).Result(); n != 12 {
		t.Errorf("counter %s holds %d bytes, want 12", keys[0], n)
	}
	if ttl, _ := c.PTTL(ctx, keys[0]).Result(); ttl <= 0 || ttl > time.Minute {
		t.Errorf("counter %s ttl = %v, want within its window", keys[0], ttl)
	}
}

// TestCountBatchEpochAndValidation: without the slot's epoch nothing is
// decided or written (ErrNoEpoch); an invalid group fails alone.
func TestCountBatchEpochAndValidation(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client()
	ctx := context.Background()
	l := limits.New(c, limits.Options{})
	r := policy.Rule{Limit: policy.Limit{Name: "h", Kind: policy.Fixed, Unit: policy.Tokens, Limit: 10, Window: policy.Duration(time.Hour)}, Scope: policy.ScopeGlobal}
	ok := []limits.SharedRequest{{Scope: policy.ScopeGlobal, ID: "x", Cost: 1, Rules: []policy.Rule{r}}}
	out := l.CountBatch(ctx, [][]limits.SharedRequest{ok})
	if !errors.Is(out[0].Err, limits.ErrNoEpoch) {
		t.Fatalf("CountBatch without the epoch error = %v, want ErrNoEpoch", out[0].Err)
	}
	if n, _ := c.DBSize(ctx).Result(); n != 0 {
		t.Fatalf("CountBatch without the epoch left %d keys", n)
	}
	if err := repair.WriteEpoch(ctx, c, "e"); err != nil {
		t.Fatal(err)
	}
	rolling := r
	rolling.Kind = policy.Rolling
	bad := [][]limits.SharedRequest{
		{{Scope: policy.ScopeGlobal, ID: "", Cost: 1, Rules: []policy.Rule{r}}},
		{{Scope: policy.ScopeGlobal, ID: "x", Cost: -1, Rules: []policy.Rule{r}}},
		{{Scope: policy.ScopeUser, ID: "x", Cost: 1, Rules: []policy.Rule{r}}},
		{{Scope: policy.ScopeGlobal, ID: "x", Cost: 1, Rules: []policy.Rule{rolling}}},
		ok,
	}
	out = l.CountBatch(ctx, bad)
	for i := range 4 {
		if !errors.Is(out[i].Err, limits.ErrInvalid) {
			t.Errorf("CountBatch group %d error = %v, want ErrInvalid", i, out[i].Err)
		}
	}
	if out[4].Err != nil || !out[4].Decision.Allowed || out[4].Decision.States[0].Used != 1 {
		t.Errorf("the valid group beside them = %+v, %v; want allowed, used 1", out[4].Decision, out[4].Err)
	}
	if e := l.CountBatch(ctx, [][]limits.SharedRequest{{}}); e[0].Err != nil || !e[0].Decision.Allowed {
		t.Errorf("an empty group = %+v, %v; want allowed", e[0].Decision, e[0].Err)
	}
	var _ redis.Cmdable = c
}

// TestCountBatchManyKeysAreAllDecided sends a full batch of groups of the
// most descriptors a ShouldRateLimit request has, each counter its own
// scope id (so its own epoch key and slot): 64×64 counters and as many
// epoch keys are more than Lua unpacks at once, so they must go out in
// several calls, each group decided and charged. A group of more than
// MaxCounters counters fails alone.
func TestCountBatchManyKeysAreAllDecided(t *testing.T) {
	c := redistest.Shared(t)
	l := limitstest.At(c, 0)
	ctx := context.Background()
	r := policy.Rule{Limit: policy.Limit{Name: "day", Kind: policy.Fixed, Unit: policy.Tokens, Limit: 10, Window: policy.Duration(24 * time.Hour)}, Scope: policy.ScopeGlobal}
	if time.Until(time.Now().Truncate(24*time.Hour).Add(24*time.Hour)) < time.Minute {
		t.Skip("within a minute of the day's window end")
	}
	name := redistest.UniqueName(t)
	slots := map[uint16]bool{}
	groups := make([][]limits.SharedRequest, 64)
	for g, n := 0, 0; g < len(groups); n++ {
		id := name + strconv.Itoa(n)
		if s := wire.CounterSlot(policy.ScopeGlobal, id); !slots[s] {
			slots[s] = true
			groups[g] = append(groups[g], limits.SharedRequest{Scope: policy.ScopeGlobal, ID: id, Cost: 3, Rules: []policy.Rule{r}})
			if len(groups[g]) == 64 {
				g++
			}
		}
	}
	big := make([]limits.SharedRequest, limits.MaxCounters+1)
	for i := range big {
		big[i] = limits.SharedRequest{Scope: policy.ScopeGlobal, ID: name + "big", Cost: 0, Rules: []policy.Rule{r}}
	}
	out := l.CountBatch(ctx, append(groups, big))
	for g := range groups {
		if out[g].Err != nil || !out[g].Decision.Allowed {
			t.Fatalf("CountBatch group %d allowed = %v, error = %v; want allowed", g, out[g].Decision.Allowed, out[g].Err)
		}
	}
	if !errors.Is(out[64].Err, limits.ErrInvalid) {
		t.Errorf("a group of %d counters error = %v, want ErrInvalid", len(big), out[64].Err)
	}
	// Each counter holds its one charge.
	check := make([][]limits.SharedRequest, len(groups))
	for g := range groups {
		check[g] = append([]limits.SharedRequest(nil), groups[g]...)
		for i := range check[g] {
			check[g][i].Cost = 0
		}
	}
	for g, o := range l.CountBatch(ctx, check) {
		if o.Err != nil {
			t.Fatalf("check of group %d error = %v", g, o.Err)
		}
		for i, s := range o.Decision.States {
			if s.Used != 3 {
				t.Fatalf("counter %d of group %d holds %d, want 3", i, g, s.Used)
			}
		}
	}
}

// TestCountBatchGiveBackOutlivesTheCaller denies a group on a cluster in
// one slot while its part in another slot took its charge, with a caller
// that leaves (its context cancelled) once the decision is made: the give
// back still lands. When the give back itself fails, the group says so.
func TestCountBatchGiveBackOutlivesTheCaller(t *testing.T) {
	cc := redistest.Cluster(t)
	ctx := context.Background()
	if err := repair.WriteEpoch(ctx, cc, "count"); err != nil {
		t.Fatal(err)
	}
	hook := &redistest.ScriptHook{}
	cc.AddHook(hook)
	l := limits.New(cc, limits.Options{})
	rule := func(limit int64) policy.Rule {
		return policy.Rule{Limit: policy.Limit{Name: "day" + strconv.FormatInt(limit, 10), Kind: policy.Fixed, Unit: policy.Tokens, Limit: limit, Window: policy.Duration(24 * time.Hour)}, Scope: policy.ScopeGlobal}
	}
	if time.Until(time.Now().Truncate(24*time.Hour).Add(24*time.Hour)) < time.Minute {
		t.Skip("within a minute of the day's window end")
	}
	name := redistest.UniqueName(t)
	a, b := name+"a", name+"b"
	for n := 0; wire.CounterSlot(policy.ScopeGlobal, a) == wire.CounterSlot(policy.ScopeGlobal, b); n++ {
		b = name + "b" + strconv.Itoa(n)
	}
	group := []limits.SharedRequest{
		{Scope: policy.ScopeGlobal, ID: a, Cost: 5, Rules: []policy.Rule{rule(10)}},
		{Scope: policy.ScopeGlobal, ID: b, Cost: 5, Rules: []policy.Rule{rule(0)}},
	}
	// used is what a's counter holds (a check of no cost, which also loads
	// the script on both slots' nodes before the hook counts calls).
	used := func() int64 {
		t.Helper()
		check := []limits.SharedRequest{group[0], group[1]}
		check[0].Cost, check[1].Cost = 0, 0
		out := l.CountBatch(ctx, [][]limits.SharedRequest{check})
		if out[0].Err != nil {
			t.Fatal(out[0].Err)
		}
		return out[0].Decision.States[0].Used
	}
	if u := used(); u != 0 {
		t.Fatalf("a's counter holds %d before the test, want 0", u)
	}

	// The caller leaves as soon as the decision's round trip is back.
	cctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	var calls atomic.Int32
	leave := func(_ []redis.Cmder, next func() error) error {
		err := next()
		if calls.Add(1) == 1 {
			cancel()
		}
		return err
	}
	hook.F.Store(&leave)
	out := l.CountBatch(cctx, [][]limits.SharedRequest{group})
	hook.F.Store(nil)
	if out[0].Err != nil || out[0].Decision.Allowed || out[0].GiveBack != nil {
		t.Fatalf("CountBatch = allowed %v, error %v, give back %v; want denied, no errors", out[0].Decision.Allowed, out[0].Err, out[0].GiveBack)
	}
	if calls.Load() != 2 {
		t.Fatalf("%d script round trips, want the decision and the give back", calls.Load())
	}
	if u := used(); u != 0 {
		t.Fatalf("a's counter holds %d after the caller left, want 0 (given back)", u)
	}

	// A give back that fails is reported, and its charge stays.
	hook.FailAfter(1)
	out = l.CountBatch(ctx, [][]limits.SharedRequest{group})
	hook.F.Store(nil)
	if out[0].Err != nil || out[0].Decision.Allowed || out[0].GiveBack == nil {
		t.Fatalf("CountBatch = allowed %v, error %v, give back %v; want denied, a give back error", out[0].Decision.Allowed, out[0].Err, out[0].GiveBack)
	}
	if u := used(); u != 5 {
		t.Fatalf("a's counter holds %d after a failed give back, want 5", u)
	}
}

// TestCountBatchTenantCountersShareItsSlot keeps a group's counters of
// several ids with one Tenant in that tenant's slot, on a cluster: the
// group is one script call (the same ids without the tenant, each of its
// own slot, are two, and other counters), its keys lie in the tenant's
// slot beside its blobs, and AdjustCount with the tenant moves them.
func TestCountBatchTenantCountersShareItsSlot(t *testing.T) {
	cc := redistest.Cluster(t)
	ctx := context.Background()
	if err := repair.WriteEpoch(ctx, cc, "count"); err != nil {
		t.Fatal(err)
	}
	if time.Until(time.Now().Truncate(24*time.Hour).Add(24*time.Hour)) < time.Minute {
		t.Skip("within a minute of the day's window end")
	}
	hook := &redistest.ScriptHook{}
	cc.AddHook(hook)
	var scripts atomic.Int32
	count := func(cmds []redis.Cmder, next func() error) error {
		for _, c := range cmds {
			if c.Name() == "fcall" || c.Name() == "evalsha" || c.Name() == "eval" {
				scripts.Add(1)
			}
		}
		return next()
	}
	hook.F.Store(&count)
	l := limits.New(cc, limits.Options{})
	day := policy.Rule{Limit: policy.Limit{Name: "day", Kind: policy.Fixed, Unit: policy.Tokens, Limit: 10, Window: policy.Duration(24 * time.Hour)}, Scope: policy.ScopeGlobal}
	ipDay := day
	ipDay.Scope = policy.ScopeIP
	name := redistest.UniqueName(t)
	tenant, a, b := name+"-t", name+"a", name+"b"
	for n := 0; wire.CounterSlot(policy.ScopeGlobal, a) == wire.CounterSlot(policy.ScopeGlobal, b); n++ {
		b = name + "b" + strconv.Itoa(n)
	}
	group := func(tenant string, cost int64) [][]limits.SharedRequest {
		return [][]limits.SharedRequest{{
			{Scope: policy.ScopeGlobal, Tenant: tenant, ID: a, Cost: cost, Rules: []policy.Rule{day}},
			{Scope: policy.ScopeIP, Tenant: tenant, ID: b, Cost: cost, Rules: []policy.Rule{ipDay}},
		}}
	}
	// Checks of no cost load the script on every node the groups reach
	// before the hook counts calls.
	for _, tenant := range []string{tenant, ""} {
		if out := l.CountBatch(ctx, group(tenant, 0)); out[0].Err != nil {
			t.Fatal(out[0].Err)
		}
	}
	for _, tc := range []struct {
		tenant  string
		scripts int32
		used    int64
	}{{tenant, 1, 4}, {"", 2, 6}} {
		scripts.Store(0)
		out := l.CountBatch(ctx, group(tc.tenant, tc.used))
		if out[0].Err != nil || !out[0].Decision.Allowed {
			t.Fatalf("CountBatch(tenant %q) = allowed %v, error %v; want allowed", tc.tenant, out[0].Decision.Allowed, out[0].Err)
		}
		if got := scripts.Load(); got != tc.scripts {
			t.Errorf("CountBatch(tenant %q) made %d script calls, want %d", tc.tenant, got, tc.scripts)
		}
		for i, s := range out[0].Decision.States {
			if s.Used != tc.used {
				t.Errorf("CountBatch(tenant %q) counter %d used = %d, want %d (counters of their own)", tc.tenant, i, s.Used, tc.used)
			}
		}
	}
	tenantSlot := cc.ClusterKeySlot(ctx, "q{"+tenant+"}t").Val()
	var keys []string
	var mu sync.Mutex
	if err := cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
		ks, err := c.Keys(ctx, "q{"+tenant+"}*").Result()
		mu.Lock()
		keys = append(keys, ks...)
		mu.Unlock()
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if len(keys) != 2 {
		t.Fatalf("keys of the tenant = %v, want its two counters", keys)
	}
	for _, k := range keys {
		if slot := cc.ClusterKeySlot(ctx, k).Val(); slot != tenantSlot {
			t.Errorf("counter %s is in slot %d, want the tenant's %d", k, slot, tenantSlot)
		}
	}
	st, err := l.AdjustCount(ctx, policy.ScopeGlobal, tenant, a, []policy.Rule{day}, -3, time.Time{})
	if err != nil || len(st) != 1 || st[0].Used != 1 {
		t.Fatalf("AdjustCount(tenant) = %+v, %v; want used 1", st, err)
	}
}

// TestAdjustCount moves CountBatch counters: a token rule by the amount, a
// requests rule by 1, held at 0, never refused by a limit; a give back
// dated in a window that has ended since leaves the new window alone, one
// dated in the current window or undated applies; bad input is refused.
func TestAdjustCount(t *testing.T) {
	c := redistest.Shared(t)
	ctx := context.Background()
	// Five minutes into an hour, and the next hour.
	offset := 5*time.Minute - time.Duration(time.Now().UnixNano()%int64(time.Hour))
	l, next := limitstest.At(c, offset), limitstest.At(c, offset+time.Hour)
	fixed := func(name string, unit policy.Unit) policy.Rule {
		return policy.Rule{Limit: policy.Limit{Name: name, Kind: policy.Fixed, Unit: unit, Limit: 10, Window: policy.Duration(time.Hour)}, Scope: policy.ScopeGlobal}
	}
	rules := []policy.Rule{fixed("tokens", policy.Tokens), fixed("reqs", policy.Requests)}
	id := redistest.UniqueName(t)
	charge := func(l *limits.Limiter, cost int64) time.Time {
		t.Helper()
		out := l.CountBatch(ctx, [][]limits.SharedRequest{{{Scope: policy.ScopeGlobal, ID: id, Cost: cost, Rules: rules}}})
		if out[0].Err != nil || !out[0].Decision.Allowed {
			t.Fatalf("CountBatch = allowed %v, error %v; want allowed", out[0].Decision.Allowed, out[0].Err)
		}
		return out[0].Decision.Now
	}
	adjust := func(l *limits.Limiter, amount int64, at time.Time, want ...int64) {
		t.Helper()
		st, err := l.AdjustCount(ctx, policy.ScopeGlobal, "", id, rules, amount, at)
		if err != nil {
			t.Fatalf("AdjustCount(%d, %v) error = %v", amount, at, err)
		}
		for i, s := range st {
			if s.Used != want[i] || s.Limit != 10 || s.Remaining != max(0, 10-want[i]) {
				t.Fatalf("AdjustCount(%d, %v) state %d = %+v, want used %d", amount, at, i, s, want[i])
			}
		}
	}
	before := charge(l, 6)
	adjust(l, 8, time.Time{}, 14, 2)  // past the limit: not refused
	adjust(l, -3, before, 11, 1)      // dated in this window
	adjust(l, -20, time.Time{}, 0, 0) // held at 0
	charge(l, 4)
	// The window turns over: a give back dated in the last one is no
	// longer this window's to take.
	charge(next, 7)
	adjust(next, -4, before, 7, 1)
	adjust(next, -4, time.Time{}, 3, 0)

	for _, bad := range []struct {
		amount int64
		rules  []policy.Rule
		at     time.Time
	}{
		{limits.MaxCost + 1, rules, time.Time{}},
		{1, make([]policy.Rule, limits.MaxCounters+1), time.Time{}},
		{1, []policy.Rule{{Limit: policy.Limit{Name: "r", Kind: policy.Rolling, Unit: policy.Tokens, Limit: 1, Window: policy.Duration(time.Hour)}}}, time.Time{}},
		{1, rules, time.UnixMilli(-5)},
		{-1, rules, time.UnixMilli(1 << 47)}, // past '<i6': it would wrap negative, which count.lua reads as now
	} {
		if _, err := l.AdjustCount(ctx, policy.ScopeGlobal, "", id, bad.rules, bad.amount, bad.at); !errors.Is(err, limits.ErrInvalid) {
			t.Errorf("AdjustCount(%d, %d rules, %v) error = %v, want ErrInvalid", bad.amount, len(bad.rules), bad.at, err)
		}
	}
}

// lostSlot starts a Redis with every slot's epoch but counter b's, and
// returns a limiter on it (5 minutes into an hour, so that no window ends
// within a test), an hourly requests rule and the requests of counters a
// and b under it.
func lostSlot(t *testing.T) (*redis.Client, *limits.Limiter, policy.Rule, limits.SharedRequest, limits.SharedRequest) {
	t.Helper()
	srv := redistest.Start(t)
	c := srv.Client()
	ctx := context.Background()
	offset := 5*time.Minute - time.Duration(time.Now().UnixNano()%int64(time.Hour))
	l := limits.New(c, limits.Options{ClockOffset: offset})
	if err := repair.WriteEpoch(ctx, c, "e"); err != nil {
		t.Fatal(err)
	}
	r := policy.Rule{Limit: policy.Limit{Name: "h", Kind: policy.Fixed, Unit: policy.Requests, Limit: 10, Window: policy.Duration(time.Hour)}, Scope: policy.ScopeGlobal}
	a := limits.SharedRequest{Scope: policy.ScopeGlobal, ID: "a", Cost: 1, Rules: []policy.Rule{r}}
	b := limits.SharedRequest{Scope: policy.ScopeGlobal, ID: "b", Cost: 1, Rules: []policy.Rule{r}}
	if wire.CounterSlot(policy.ScopeGlobal, "a") == wire.CounterSlot(policy.ScopeGlobal, "b") {
		t.Fatal("a and b share a slot: pick other ids")
	}
	if err := c.Del(ctx, wire.SlotEpochKey(wire.CounterSlot(policy.ScopeGlobal, "b"))).Err(); err != nil {
		t.Fatal(err)
	}
	return c, l, r, a, b
}

// TestCountBatchGroupLosesOneEpoch: a group whose second counter's slot
// lost its epoch is decided nowhere (ErrNoEpoch), though its first counter
// fitted and was counted in the script: the groups after it in the same
// call see that counter as it was, and nothing of the group is written.
func TestCountBatchGroupLosesOneEpoch(t *testing.T) {
	c, l, r, a, b := lostSlot(t)
	ctx := context.Background()
	out := l.CountBatch(ctx, [][]limits.SharedRequest{{a, b}, {a}, {a, a}})
	if !errors.Is(out[0].Err, limits.ErrNoEpoch) {
		t.Fatalf("the group with b: %+v, %v; want ErrNoEpoch", out[0].Decision, out[0].Err)
	}
	if out[1].Err != nil || !out[1].Decision.Allowed || out[1].Decision.States[0].Used != 1 {
		t.Errorf("a alone after it: %+v, %v; want allowed, used 1 (the lost group's charge undone)", out[1].Decision, out[1].Err)
	}
	if out[2].Err != nil || !out[2].Decision.Allowed || out[2].Decision.States[1].Used != 3 {
		t.Errorf("a twice after that: %+v, %v; want allowed, used 3", out[2].Decision, out[2].Err)
	}
	// Lost last in its call: nothing of it is left in the reply either.
	out = l.CountBatch(ctx, [][]limits.SharedRequest{{a}, {a, b}})
	if out[0].Err != nil || !out[0].Decision.Allowed || out[0].Decision.States[0].Used != 4 {
		t.Errorf("a before a lost group: %+v, %v; want allowed, used 4", out[0].Decision, out[0].Err)
	}
	if !errors.Is(out[1].Err, limits.ErrNoEpoch) {
		t.Errorf("a lost group last: %+v, %v; want ErrNoEpoch", out[1].Decision, out[1].Err)
	}
	key := func(id string) string {
		return (&wire.Counter{Scope: policy.ScopeGlobal, ID: id, Rule: &r}).Key()
	}
	if n, _ := c.Exists(ctx, key("b")).Result(); n != 0 {
		t.Errorf("b's counter written by the group that lost its epoch")
	}
	if v, _ := c.Get(ctx, key("a")).Result(); len(v) != 12 {
		t.Errorf("a's counter %q, want window and count", v)
	} else if n := int64(v[6]) | int64(v[7])<<8; n != 4 {
		t.Errorf("a's count %d, want 4", n)
	}
}

// TestCountBatchLostMidGroupMidCall: a group losing its epoch in the
// middle of the call, on a middle counter after a repeated one: the groups on either side see only each other; an
// adjustment of the lost slot is refused and writes nothing.
func TestCountBatchLostMidGroupMidCall(t *testing.T) {
	c, l, r, a, b := lostSlot(t)
	ctx := context.Background()
	out := l.CountBatch(ctx, [][]limits.SharedRequest{{a}, {a, a, b, a}, {a}})
	if out[0].Err != nil || out[0].Decision.States[0].Used != 1 {
		t.Fatalf("first: %+v %v", out[0].Decision, out[0].Err)
	}
	if !errors.Is(out[1].Err, limits.ErrNoEpoch) {
		t.Fatalf("lost: %v", out[1].Err)
	}
	if out[2].Err != nil || out[2].Decision.States[0].Used != 2 {
		t.Fatalf("last: %+v %v; want used 2", out[2].Decision, out[2].Err)
	}
	if _, err := l.AdjustCount(ctx, policy.ScopeGlobal, "", "b", []policy.Rule{r}, 1, time.Time{}); !errors.Is(err, limits.ErrNoEpoch) {
		t.Fatalf("AdjustCount of the lost slot: %v, want ErrNoEpoch", err)
	}
	if n, _ := c.Exists(ctx, (&wire.Counter{Scope: policy.ScopeGlobal, ID: "b", Rule: &r}).Key()).Result(); n != 0 {
		t.Fatal("b written")
	}
}
