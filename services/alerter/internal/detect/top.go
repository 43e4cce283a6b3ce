package detect

import (
	"cmp"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"quotaflow/internal/obs"
	"quotaflow/pkg/events"
)

// DefaultTopTenants is how many tenants the top-tenant gauges show.
const DefaultTopTenants = 10

// topTenants keeps the last snapshot of every tenant-scope token limit and
// exports, for the n tenants nearest one of their limits, the used and
// remaining tokens of each: quotaflow_alerter_top_tenant_tokens_used and
// _remaining{tenant,limit}. The alerter computes it because it sees every
// snapshot of every limit as admission decides (the accounter sees the
// ledger's actual tokens, not what is left of each limit). What it keeps
// is bounded by the policy: only tenants listed in it have tenant-scope
// limits. A tenant leaving the top n has its series deleted, so the
// gauges hold at most n tenants' series. A snapshot past its limit's reset
// time counts no more: the window has reset, or freed usage the alerter
// cannot measure, so its series go (and the tenant leaves the top when no
// other limit keeps it there) until the tenant's next snapshot says where
// the window stands.
type topTenants struct {
	n               int
	used, remaining *prometheus.GaugeVec

	mu     sync.Mutex
	last   map[[2]string]topSnap // (tenant, limit name) → last snapshot
	shown  map[string]bool       // tenants with series
	sorted []string              // scratch
}

type topSnap struct {
	version           int64 // the tenant's version: an older snapshot is ignored
	used, remain, lim int64
	resets            time.Time // when the window frees capacity or resets; zero: never
}

// current reports whether s still describes its window at now.
func (s topSnap) current(now time.Time) bool { return s.resets.IsZero() || now.Before(s.resets) }

func newTopTenants(n int, reg prometheus.Registerer) (*topTenants, error) {
	t := &topTenants{
		n: n, last: map[[2]string]topSnap{}, shown: map[string]bool{},
		used: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "quotaflow_alerter_top_tenant_tokens_used",
			Help: "Tokens used in each tenant-scope token limit of the top tenants (those nearest a limit; QF_TOP_TENANTS).",
		}, []string{"tenant", "limit"}),
		remaining: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "quotaflow_alerter_top_tenant_tokens_remaining",
			Help: "Tokens remaining in each tenant-scope token limit of the top tenants (those nearest a limit; QF_TOP_TENANTS).",
		}, []string{"tenant", "limit"}),
	}
	if err := obs.Register(reg, t.used, t.remaining); err != nil {
		return nil, fmt.Errorf("register top tenant metrics: %w", err)
	}
	return t, nil
}

// add records the tenant-scope token limits of a snapshot of tenant taken
// at at, at tenantVersion (0: unordered, always taken).
func (t *topTenants) add(tenant string, at time.Time, tenantVersion int64, limits []events.LimitState) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, l := range limits {
		if l.Scope != "tenant" || l.Unit != "tokens" {
			continue
		}
		k := [2]string{tenant, l.Name}
		if old, ok := t.last[k]; ok && tenantVersion > 0 && old.version > tenantVersion {
			continue
		}
		t.last[k] = topSnap{version: tenantVersion, used: l.Used, remain: l.Remaining, lim: l.Limit, resets: resetAt(at, l)}
	}
}

// forget drops the limits defined reports undefined (a policy reload
// removed them), and their series.
func (t *topTenants) forget(defined func(tenant, name string) bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for k := range t.last {
		if !defined(k[0], k[1]) {
			delete(t.last, k)
			t.used.DeleteLabelValues(k[0], k[1])
			t.remaining.DeleteLabelValues(k[0], k[1])
		}
	}
}

// publish sets the gauges to the n tenants whose most used limit is the
// fullest at now (ties by tenant), deleting the series of the others and
// of the limits past their reset.
func (t *topTenants) publish(now time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	fullest := map[string]float64{}
	for k, s := range t.last {
		if !s.current(now) {
			continue
		}
		if p := percent(s.used, s.lim); p >= fullest[k[0]] {
			fullest[k[0]] = p
		}
	}
	t.sorted = t.sorted[:0]
	for tenant := range fullest {
		t.sorted = append(t.sorted, tenant)
	}
	slices.SortFunc(t.sorted, func(a, b string) int {
		return cmp.Or(cmp.Compare(fullest[b], fullest[a]), cmp.Compare(a, b))
	})
	top := map[string]bool{}
	for _, tenant := range t.sorted[:min(t.n, len(t.sorted))] {
		top[tenant] = true
	}
	for tenant := range t.shown {
		if !top[tenant] {
			t.used.DeletePartialMatch(prometheus.Labels{"tenant": tenant})
			t.remaining.DeletePartialMatch(prometheus.Labels{"tenant": tenant})
			delete(t.shown, tenant)
		}
	}
	for k, s := range t.last {
		switch {
		case !top[k[0]]:
		case !s.current(now):
			t.used.DeleteLabelValues(k[0], k[1])
			t.remaining.DeleteLabelValues(k[0], k[1])
		default:
			t.used.WithLabelValues(k[0], k[1]).Set(float64(s.used))
			t.remaining.WithLabelValues(k[0], k[1]).Set(float64(s.remain))
			t.shown[k[0]] = true
		}
	}
}
