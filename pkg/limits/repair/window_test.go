package repair_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/internal/limitstest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
	"quotaflow/pkg/limits/repair"
)

// TestWindows: what Windows decodes from the blobs agrees with what the
// scripts report (Peek) and puts each charge in the bucket of its time.
func TestWindows(t *testing.T) {
	c := redistest.Shared(t)
	ctx := context.Background()
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{
		limitstest.Rule(policy.ScopeTenant, policy.Limit{Name: "t1m", Kind: policy.Rolling, Limit: 1e6, Window: policy.Duration(time.Minute), Buckets: 6}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "1m", Kind: policy.Rolling, Limit: 1e6, Window: policy.Duration(time.Minute), Buckets: 6}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "1h", Kind: policy.Fixed, Limit: 1e6, Window: policy.Duration(time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "month", Kind: policy.CalendarMonth, Limit: 1e6}),
	}
	l, tools := limitstest.At(c, 0), limitstest.RepairAt(c, 0)
	d := limitstest.Reserve(t, l, tenant, "u:{x}%", "r1", 100, rules)
	now := d.Now
	// Charges 25 s and 50 s back: the rolling windows hold them in older
	// buckets; the fixed and calendar windows only if still current.
	for _, back := range []time.Duration{25 * time.Second, 50 * time.Second} {
		if _, err := tools.Charge(ctx, repair.ChargeRequest{Tenant: tenant, User: "u:{x}%", Rules: rules, Amount: 7, At: now.Add(-back)}); err != nil {
			t.Fatal(err)
		}
	}
	got, ws, err := tools.Windows(ctx, tenant, "u:{x}%", rules)
	if err != nil {
		t.Fatalf("Windows = %v", err)
	}
	p := limitstest.Peek(t, l, tenant, "u:{x}%", rules)
	for i, w := range ws {
		if w.Used() != p.States[i].Used {
			t.Errorf("%s: Windows used %d, Peek %d", rules[i].Name, w.Used(), p.States[i].Used)
		}
		if w.Rule != &rules[i] {
			t.Errorf("%s: Rule points elsewhere", rules[i].Name)
		}
	}
	for _, i := range []int{0, 1} {
		w := ws[i]
		if len(w.Buckets) != 6 || w.Buckets[5].N != repair.BucketOf(&rules[i], got) {
			t.Fatalf("%s: buckets %+v, want 6 ending at the current one", rules[i].Name, w.Buckets)
		}
		for _, at := range []time.Time{now, now.Add(-25 * time.Second), now.Add(-50 * time.Second)} {
			n := repair.BucketOf(&rules[i], at)
			k := slices.IndexFunc(w.Buckets, func(b repair.Bucket) bool { return b.N == n })
			if k < 0 || w.Buckets[k].Used == 0 {
				t.Errorf("%s: bucket %d of %v empty or missing in %+v", rules[i].Name, n, at, w.Buckets)
			}
			if s := repair.BucketStart(&rules[i], n); repair.BucketOf(&rules[i], s) != n || at.Sub(s) >= 10*time.Second || at.Before(s) {
				t.Errorf("BucketStart(%d) = %v, not the start of the bucket of %v", n, s, at)
			}
		}
	}
	if ws[1].Used() != 114 {
		t.Errorf("1m used = %d, want 114", ws[1].Used())
	}

	// Two minutes later the rolling windows are empty.
	_, ws, err = limitstest.RepairAt(c, 2*time.Minute).Windows(ctx, tenant, "u:{x}%", rules)
	if err != nil || ws[0].Used() != 0 || ws[1].Used() != 0 {
		t.Errorf("Windows 2 min later = %+v, %v; want empty rolling windows", ws, err)
	}
	if _, _, err := tools.Windows(ctx, tenant, "u", []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "b", Kind: policy.Balance})}); err == nil {
		t.Error("Windows of a balance = nil error, want ErrInvalid")
	}
}

// TestWindowsMany: each result of one pipelined read is its own subject's,
// as Windows reads it alone, on one Redis (in one round trip) and across a
// Cluster's nodes; an invalid request fails alone.
func TestWindowsMany(t *testing.T) {
	for _, tc := range []struct {
		name   string
		client func(*testing.T) (redis.UniversalClient, *limitstest.Calls)
	}{
		{"redis", func(t *testing.T) (redis.UniversalClient, *limitstest.Calls) { return limitstest.CountedShared(t) }},
		{"cluster", func(t *testing.T) (redis.UniversalClient, *limitstest.Calls) { return redistest.Cluster(t), nil }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, rt := tc.client(t)
			ctx := context.Background()
			l := limitstest.RepairAt(c, 0)
			rules := []policy.Rule{
				limitstest.Rule(policy.ScopeTenant, policy.Limit{Name: "t1m", Kind: policy.Rolling, Limit: 1e9, Window: policy.Duration(time.Minute), Buckets: 6}),
				limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "1h", Kind: policy.Fixed, Limit: 1e9, Window: policy.Duration(time.Hour)}),
			}
			// 40 subjects of 8 tenants, user i charged 1+i, so a result read
			// for the wrong subject shows; an invalid request among them.
			const users, tenants = 40, 8
			base := redistest.UniqueName(t)
			var reqs []repair.WindowsRequest
			var charges []repair.ChargeRequest
			for i := range users {
				r := repair.WindowsRequest{Tenant: fmt.Sprintf("%s-%d", base, i%tenants), User: fmt.Sprintf("u%d", i), Rules: slices.Clone(rules)}
				reqs = append(reqs, r)
				charges = append(charges, repair.ChargeRequest{Tenant: r.Tenant, User: r.User, Rules: rules, Amount: int64(1 + i)})
			}
			for i, r := range l.ChargeMany(ctx, charges) {
				if r.Err != nil {
					t.Fatalf("charge %d: %v", i, r.Err)
				}
			}
			const invalid = 3
			reqs = slices.Insert(reqs, invalid, repair.WindowsRequest{Tenant: base, User: "", Rules: rules})
			if rt != nil {
				// With the script cached (a fresh node answers NOSCRIPT first).
				if _, _, err := l.Windows(ctx, base, "u", rules); err != nil {
					t.Fatal(err)
				}
				rt.Reset()
			}
			got := l.WindowsMany(ctx, reqs)
			if rt != nil && rt.Count() != 1 {
				t.Errorf("WindowsMany took %d round trips, want 1", rt.Count())
			}
			if len(got) != len(reqs) {
				t.Fatalf("WindowsMany returned %d results for %d requests", len(got), len(reqs))
			}
			if !errors.Is(got[invalid].Err, limits.ErrInvalid) {
				t.Errorf("result %d (no user) error = %v, want ErrInvalid", invalid, got[invalid].Err)
			}
			got, reqs = slices.Delete(got, invalid, invalid+1), slices.Delete(reqs, invalid, invalid+1)
			for i, r := range got {
				q := &reqs[i]
				var ten int64 // the tenant's window holds its users' charges
				for j := i % tenants; j < users; j += tenants {
					ten += int64(1 + j)
				}
				if r.Err != nil || r.Windows[0].Used() != ten || r.Windows[1].Used() != int64(1+i) {
					t.Fatalf("%s/%s: %+v, %v; want used %d and %d", q.Tenant, q.User, r.Windows, r.Err, ten, 1+i)
				}
				_, want, err := l.Windows(ctx, q.Tenant, q.User, rules)
				if err != nil {
					t.Fatal(err)
				}
				for j := range want {
					if !sameBuckets(r.Windows[j].Buckets, want[j].Buckets) {
						t.Errorf("%s/%s %s: WindowsMany %+v, Windows %+v", q.Tenant, q.User, rules[j].Name, r.Windows[j].Buckets, want[j].Buckets)
					}
					if r.Windows[j].Rule != &q.Rules[j] {
						t.Errorf("%s/%s %s: Rule points elsewhere", q.Tenant, q.User, rules[j].Name)
					}
				}
			}
		})
	}
}

func TestBucketStartOfMonths(t *testing.T) {
	r := limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "m", Kind: policy.CalendarMonth, Limit: 1})
	for _, at := range []time.Time{
		time.Date(2026, 12, 31, 23, 59, 59, 0, time.UTC),
		time.Date(2027, 1, 1, 0, 0, 0, 0, time.UTC),
		time.Date(2024, 2, 29, 12, 0, 0, 0, time.UTC),
	} {
		want := time.Date(at.Year(), at.Month(), 1, 0, 0, 0, 0, time.UTC)
		if got := repair.BucketStart(&r, repair.BucketOf(&r, at)); !got.Equal(want) {
			t.Errorf("BucketStart(BucketOf(%v)) = %v, want %v", at, got, want)
		}
	}
}

// TestScanSubjects finds every subject and tenant blob, whatever characters
// the names hold, and nothing of other tenants' keys or shared scopes.
func TestScanSubjects(t *testing.T) {
	c := redistest.Shared(t)
	ctx := context.Background()
	tenant := redistest.UniqueName(t) + "%{t}:"
	l := limitstest.At(c, 0)
	rules := []policy.Rule{
		limitstest.Rule(policy.ScopeTenant, policy.Limit{Name: "t", Kind: policy.Fixed, Limit: 1e6, Window: policy.Duration(time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "u", Kind: policy.Fixed, Limit: 1e6, Window: policy.Duration(time.Hour)}),
	}
	for _, u := range []string{"a", "%25", "b:{c}"} {
		limitstest.Reserve(t, l, tenant, u, "r", 1, rules)
	}
	if _, err := l.ReserveShared(ctx, policy.ScopeGlobal, tenant, 1, rules[:1]); err != nil {
		t.Fatal(err)
	}
	var got []string
	if err := repair.ScanSubjects(ctx, c, func(ten, user string) {
		if ten == tenant {
			got = append(got, user)
		}
	}); err != nil {
		t.Fatal(err)
	}
	slices.Sort(got)
	if want := []string{"", "%25", "a", "b:{c}"}; !slices.Equal(got, want) {
		t.Errorf("ScanSubjects found users %q, want %q", got, want)
	}
}

// sameBuckets reports whether two reads of one window agree: the same
// count in every bucket both hold, and the same total. The reads are
// moments apart, so a bucket boundary may pass between them and shift
// which buckets each holds (nothing in these tests is old enough to leave).
func sameBuckets(a, b []repair.Bucket) bool {
	at := make(map[int64]int64, len(a))
	var sa, sb int64
	for _, x := range a {
		at[x.N], sa = x.Used, sa+x.Used
	}
	for _, y := range b {
		if u, ok := at[y.N]; ok && u != y.Used {
			return false
		}
		sb += y.Used
	}
	return sa == sb
}
