package limits_test

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"quotaflow/internal/limitstest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/internal/wire"
	"quotaflow/pkg/limits/policy"
)

// Tests of a plan of fixed request windows alone (limits.Counted), whose
// reserves and peeks go to a counter per limit instead of the subject's
// blob.

// countedRules are such a plan: a tenant-wide window, a user's, and a
// shadow one of the user's.
func countedRules() []policy.Rule {
	hour := policy.Duration(time.Hour)
	return []policy.Rule{
		limitstest.Rule(policy.ScopeTenant, policy.Limit{Name: "tenant", Kind: policy.Fixed, Unit: policy.Requests, Limit: 9, Window: hour}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "hour", Kind: policy.Fixed, Unit: policy.Requests, Limit: 3, Window: hour}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "watch", Kind: policy.Fixed, Unit: policy.Requests, Limit: 1, Window: hour, Shadow: true}),
	}
}

// TestCountedPlanLivesInCounters: the reserves of such a plan are decided
// in counter keys on the tenant's hash tag, and no blob of the subject or
// the tenant exists; a denial charges nothing, a shadow limit is charged
// and flags, a peek writes nothing, and the decision carries a version.
func TestCountedPlanLivesInCounters(t *testing.T) {
	c := redistest.Shared(t)
	l := limitstest.At(c, 0)
	ctx := context.Background()
	rules := countedRules()
	if !limits.Counted(rules) || limits.Counted(nil) || limits.Counted(requestRules()) {
		t.Fatal("Counted: want true for fixed request windows alone, false for none and for other kinds")
	}
	tenant := redistest.UniqueName(t)
	var last int64 // version
	for i, want := range []struct {
		allowed   bool
		used      []int64
		wouldDeny bool
	}{
		{true, []int64{1, 1, 1}, false},
		{true, []int64{2, 2, 2}, true},
		{true, []int64{3, 3, 3}, true},
		{false, []int64{3, 3, 3}, true},
	} {
		d := reserveCounted(t, l, tenant, "u", "same-id", 50, rules)
		if d.Allowed != want.allowed || fmt.Sprint(limitstest.Used(d.States)) != fmt.Sprint(want.used) || d.States[2].WouldDeny != want.wouldDeny {
			t.Fatalf("Reserve %d = allowed %v used %v would deny %v; want %v %v %v", i+1, d.Allowed, limitstest.Used(d.States), d.States[2].WouldDeny, want.allowed, want.used, want.wouldDeny)
		}
		if d.Version != d.Now.UnixMicro() || d.TenantVersion != d.Version || d.Version <= last {
			t.Fatalf("Reserve %d: version %d, tenant version %d; want both the decision's Redis time in µs, %d, past the last %d", i+1, d.Version, d.TenantVersion, d.Now.UnixMicro(), last)
		}
		last = d.Version
		if !want.allowed && (d.DeniedBy != 1 || d.RetryAfter <= 0 || d.RetryAfter > time.Hour) {
			t.Fatalf("Reserve %d: denied by %d, retry after %v; want 1 (hour), within the hour", i+1, d.DeniedBy, d.RetryAfter)
		}
	}
	keys := wire.NewSubjectKeys(tenant, "u")
	counter := func(user string, r *policy.Rule) string {
		return (&wire.Counter{Scope: r.Scope, Tenant: tenant, ID: user, Rule: r}).Key()
	}
	for _, k := range []string{counter("u", &rules[0]), counter("u", &rules[1]), counter("u", &rules[2])} {
		if ttl := c.PTTL(ctx, k).Val(); ttl <= 0 || ttl > time.Hour {
			t.Errorf("counter %s: ttl %v, want one within its window", k, ttl)
		}
		if s, _ := wire.SlotOfKey(k); s != wire.TenantSlot(tenant) {
			t.Errorf("counter %s is on slot %d, not the tenant's %d", k, s, wire.TenantSlot(tenant))
		}
	}
	if n := c.Exists(ctx, keys.Blob(), keys.TenantBlob(), keys.Reservation("same-id")).Val(); n != 0 {
		t.Fatalf("%d of the subject's blob, the tenant's blob and a record exist, want none", n)
	}
	if d := peekCounted(t, l, tenant, "v", rules); fmt.Sprint(limitstest.Used(d.States)) != "[3 0 0]" {
		t.Fatalf("Peek of a new user = used %v, want [3 0 0]", limitstest.Used(d.States))
	}
	if n := c.Exists(ctx, counter("v", &rules[1]), counter("v", &rules[2])).Val(); n != 0 {
		t.Fatalf("Peek wrote %d counters of the new user, want none", n)
	}
}

// TestCountedPlanChangingShape: a plan that gains a token limit moves its
// request window to the blob, where it starts from what the blob holds
// (nothing), and back to the counter, which goes on from its own count: a
// request is counted in one store only.
func TestCountedPlanChangingShape(t *testing.T) {
	l := limitstest.At(redistest.Shared(t), 0)
	tenant := redistest.UniqueName(t)
	counted := countedRules()[1:2] // hour: 3
	mixed := append(countedRules()[1:2], limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "tokens", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(time.Hour)}))
	for i, step := range []struct {
		rules []policy.Rule
		used  int64 // the hour's, after it
	}{{counted, 1}, {counted, 2}, {mixed, 1}, {mixed, 2}, {counted, 3}} {
		d := reserveCounted(t, l, tenant, "u", "r"+strconv.Itoa(i), 10, step.rules)
		if !d.Allowed || d.States[0].Used != step.used {
			t.Fatalf("step %d (%d rules) = allowed %v, hour used %d; want allowed, %d", i, len(step.rules), d.Allowed, d.States[0].Used, step.used)
		}
	}
	if d := reserveCounted(t, l, tenant, "u", "last", 10, counted); d.Allowed {
		t.Fatal("a fourth request in the counter's window was allowed")
	}
}

// TestCountedReservesMixWithBlobsInABatch: one ReserveBatch of counted and
// blob requests answers each in its place, and concurrent batches allow
// exactly the limits.
func TestCountedReservesMixWithBlobsInABatch(t *testing.T) {
	l := limitstest.At(redistest.Shared(t), 0)
	tenant := redistest.UniqueName(t)
	counted := countedRules()[:2] // tenant 9, hour 3
	blob := requestRules()[1:3]   // hour 5, log 6: a sliding log is no counter
	var allowed [2]atomic.Int64   // of the counted user, of the blob user
	var wg sync.WaitGroup
	for w := range 6 {
		wg.Go(func() {
			for i := range 4 {
				rs := []limits.Request{
					{Tenant: tenant, User: "c", RequestID: fmt.Sprint(w, i), Rules: counted, Counted: true},
					{Tenant: tenant, User: "b", RequestID: fmt.Sprint(w, i), Rules: blob},
					{Tenant: tenant, User: "c", RequestID: fmt.Sprint(w, i, "again"), Rules: counted, Counted: true},
				}
				for k, o := range l.ReserveBatch(context.Background(), rs) {
					if o.Err != nil {
						t.Error(o.Err)
						return
					}
					if len(o.Decision.States) != len(rs[k].Rules) || o.Decision.States[0].Rule != &rs[k].Rules[0] {
						t.Errorf("ReserveBatch[%d]: states of other rules", k)
						return
					}
					if o.Decision.Allowed {
						allowed[k%2].Add(1)
					}
				}
			}
		})
	}
	wg.Wait()
	if a, b := allowed[0].Load(), allowed[1].Load(); a != 3 || b != 5 {
		t.Fatalf("allowed %d counted and %d blob reserves of 48 and 24, want 3 and 5 (the limits)", a, b)
	}
}

// TestCountedPlanOnClusterSpansNodes: the counters of many tenants, each
// with a tenant-wide and a user's window, are decided on their tenants'
// nodes of a cluster, every call of the batch.
func TestCountedPlanOnClusterSpansNodes(t *testing.T) {
	cc := redistest.Cluster(t)
	l := limits.New(cc, limits.Options{NoEpochGuard: true})
	rules := countedRules()[:2]
	base := redistest.UniqueName(t)
	var rs []limits.Request
	for i := range 30 {
		rs = append(rs, limits.Request{Tenant: base + strconv.Itoa(i), User: "u", RequestID: "r", Rules: rules, Counted: true})
	}
	for round := range 4 {
		for i, o := range l.ReserveBatch(context.Background(), rs) {
			want := round < 3
			if o.Err != nil || o.Decision.Allowed != want || o.Decision.States[1].Used != int64(min(round+1, 3)) {
				t.Fatalf("round %d: ReserveBatch[%d] = %+v, %v; want allowed %v", round, i, o.Decision, o.Err, want)
			}
		}
	}
}

// TestCountedVersionsGrowWithinACall: the reserves of one subject in one
// call, which share its Redis time, get versions in their order.
func TestCountedVersionsGrowWithinACall(t *testing.T) {
	l := limitstest.At(redistest.Shared(t), 0)
	tenant := redistest.UniqueName(t)
	rs := make([]limits.Request, 5)
	for i := range rs {
		rs[i] = limits.Request{Tenant: tenant, User: "u", RequestID: "r", Rules: countedRules(), Counted: true}
	}
	var last int64
	for i, o := range l.ReserveBatch(context.Background(), rs) {
		if o.Err != nil || o.Decision.Version <= last || o.Decision.States[1].Used != int64(min(i+1, 3)) {
			t.Fatalf("ReserveBatch[%d] = version %d (last %d), used %v, %v; want a later version", i, o.Decision.Version, last, limitstest.Used(o.Decision.States), o.Err)
		}
		last = o.Decision.Version
	}
}

// reserveCounted is limitstest.Reserve of a Request that may be counted
// (Request.Counted).
func reserveCounted(t *testing.T, l *limits.Limiter, tenant, user, id string, cost int64, rules []policy.Rule) limits.Decision {
	t.Helper()
	return limitstest.ReserveRequest(t, l, limits.Request{Tenant: tenant, User: user, RequestID: id, Cost: cost, Rules: rules, Counted: true})
}

// peekCounted is limitstest.Peek of a Request that may be counted.
func peekCounted(t *testing.T, l *limits.Limiter, tenant, user string, rules []policy.Rule) limits.Decision {
	t.Helper()
	d, err := l.Peek(context.Background(), limits.Request{Tenant: tenant, User: user, Rules: rules, Counted: true})
	if err != nil {
		t.Fatalf("Peek error = %v", err)
	}
	return d
}
