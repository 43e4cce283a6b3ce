package e2e_test

import (
	"bytes"
	"cmp"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"
)

// twoInstPolicy holds the limits a Redis outage decides locally, per user
// and per tenant: request limits (rates) from each instance's share,
// token quotas from the remaining Redis last reported to the instance
// (docs/design.md §4). Tenant reqs is bound by request limits (its users
// ask 1 token a request), tenant toks by token quotas (1000 a request).
// Windows of 24 h: a share refills by 20 ÷ 86400 s, under one request
// in the test's run.
const twoInstPolicy = `
default_plan: p
plans:
  p:
    quotas: [{name: day, kind: rolling, window: 24h, limit: 20000}]
    rates: [{name: rday, kind: rolling, window: 24h, limit: 40}]
tenants:
  reqs:
    plan: p
    quotas: [{name: tday, kind: rolling, window: 24h, limit: 30000}]
    rates: [{name: trday, kind: rolling, window: 24h, limit: 100}]
  toks:
    plan: p
    quotas: [{name: tday, kind: rolling, window: 24h, limit: 30000}]
    rates: [{name: trday, kind: rolling, window: 24h, limit: 100}]
`

// twoInstUsers are the users driven through both instances, with the
// tokens each request asks for.
var twoInstUsers = []struct {
	tenant, user string
	cost         int64
}{
	{"reqs", "r1", 1}, {"reqs", "r2", 1}, {"reqs", "r3", 1},
	{"toks", "t1", 1000}, {"toks", "t2", 1000},
}

// limitKey names a limit of one owner: a user's (user set) or its
// tenant's.
type limitKey struct{ scope, tenant, user, name string }

// outage is what one run measured: per instance and limit, the units
// admitted during the outage and the bound the documented formula gives;
// per limit, its size and what Redis held before the outage.
type outage struct {
	admitted, bound []map[limitKey]int64
	limit, used     map[limitKey]int64
	unit            map[limitKey]string
}

// TestTwoInstancesRedisDown runs two admission processes on one Redis,
// records usage through both, kills Redis and drives concurrent admits of
// the same users and tenants through both until every one is denied. With
// QF_INSTANCES=2 each instance stays within its bound (docs/design.md §4):
// a request limit within its share, ceil(limit ÷ 2), a token quota within
// the remaining Redis last reported to it; so the window holds at most
// what Redis counted before plus both bounds. The tenant limits that bind
// (reqs' requests, toks' tokens) reach their bounds exactly. With
// QF_INSTANCES=1 on both, the request limits pass the two-instance bounds:
// the check can fail.
func TestTwoInstancesRedisDown(t *testing.T) {
	// Both runs at once, each on a stack of its own: half the wall time.
	var two, one outage
	t.Run("runs", func(t *testing.T) {
		t.Run("QF_INSTANCES=2", func(t *testing.T) { t.Parallel(); two = runOutage(t, 2) })
		t.Run("QF_INSTANCES=1", func(t *testing.T) { t.Parallel(); one = runOutage(t, 1) })
	})
	if t.Failed() {
		return
	}
	keys := slices.SortedFunc(maps.Keys(two.limit), func(a, b limitKey) int {
		return cmp.Or(cmp.Compare(a.tenant, b.tenant), cmp.Compare(b.scope, a.scope), cmp.Compare(a.user, b.user), cmp.Compare(a.name, b.name))
	})
	for _, k := range keys {
		lim := two.limit[k]
		var sum, bound int64
		for i := range two.admitted {
			a, b := two.admitted[i][k], two.bound[i][k]
			sum, bound = sum+a, bound+b
			if a > b {
				t.Errorf("instance %d admitted %d %s of %v, over its bound %d", i+1, a, two.unit[k], k, b)
			}
			if binds := (k == limitKey{"tenant", "reqs", "", "trday"} || k == limitKey{"tenant", "toks", "", "tday"}); binds && a != b {
				t.Errorf("instance %d admitted %d %s of %v, want its bound %d reached exactly", i+1, a, two.unit[k], k, b)
			}
		}
		over := two.used[k] + sum - lim
		t.Logf("%v (%s, limit %d, used before %d): admitted %d + %d = %d during the outage, bound %d; window total %d = limit %+d (bound %+d)",
			k, two.unit[k], lim, two.used[k], two.admitted[0][k], two.admitted[1][k], sum, bound,
			two.used[k]+sum, over, two.used[k]+bound-lim)
	}

	k := limitKey{"tenant", "reqs", "", "trday"}
	sum, bound := one.admitted[0][k]+one.admitted[1][k], two.bound[0][k]+two.bound[1][k]
	t.Logf("QF_INSTANCES=1: %v admitted %d + %d = %d, the two-instance bound %d", k, one.admitted[0][k], one.admitted[1][k], sum, bound)
	if sum <= bound {
		t.Errorf("with QF_INSTANCES=1, %v admitted %d, want more than the two-instance bound %d (else the check is vacuous)", k, sum, bound)
	}
	// Each instance's 100 requests of tenant reqs went to three users: one
	// took at least 34, over its two-instance share of 20.
	for i := range one.admitted {
		most := int64(0)
		for _, u := range twoInstUsers[:3] {
			most = max(most, one.admitted[i][limitKey{"user", "reqs", u.user, "rday"}])
		}
		t.Logf("QF_INSTANCES=1: instance %d admitted at most %d requests of one user of reqs, the two-instance share %d", i+1, most, two.bound[i][limitKey{"user", "reqs", "r1", "rday"}])
		if most <= two.bound[i][limitKey{"user", "reqs", "r1", "rday"}] {
			t.Errorf("with QF_INSTANCES=1, instance %d admitted at most %d requests of a user, want more than the two-instance share", i+1, most)
		}
	}
}

// runOutage starts two admission instances with QF_INSTANCES=instances,
// records 3 requests of each user through Redis (instance 1, 2, 1), kills
// Redis, and drives every user concurrently through both instances until
// each is denied.
func runOutage(t *testing.T, instances int) outage {
	t.Helper()
	s := startStack(t, stackConfig{policy: twoInstPolicy, instances: 2, admission: []string{
		"QF_INSTANCES=" + strconv.Itoa(instances),
		// Every known-state request decided by Redis even on a loaded
		// host, and local limits for the whole outage, not past 30 s.
		"QF_REDIS_TIMEOUT=5s", "QF_FAILOPEN_AFTER=0",
	}})
	o := outage{limit: map[limitKey]int64{}, used: map[limitKey]int64{}, unit: map[limitKey]string{}}
	lastSeen := make([]map[limitKey]int64, 2) // the remaining Redis last reported to each instance
	for i := range 2 {
		lastSeen[i] = map[limitKey]int64{}
		o.admitted = append(o.admitted, map[limitKey]int64{})
		o.bound = append(o.bound, map[limitKey]int64{})
	}
	seq := 0
	for _, u := range twoInstUsers {
		for _, i := range []int{0, 1, 0} {
			seq++
			code, d, err := admitAt(s.apis[i], admitReq{RequestID: fmt.Sprintf("known-%d", seq), Tenant: u.tenant, User: u.user,
				Endpoint: "/v1/chat", Estimate: u.cost})
			if err != nil || code != http.StatusOK || len(d.Limits) != 4 {
				t.Fatalf("known state: admit of %s/%s at instance %d = %d %+v %v, want allowed with 4 limits", u.tenant, u.user, i+1, code, d, err)
			}
			for _, l := range d.Limits {
				k := limitKey{l.Scope, u.tenant, u.user, l.Name}
				if l.Scope == "tenant" {
					k.user = ""
				}
				units := int64(1)
				if l.Unit == "tokens" {
					units = u.cost
				}
				o.used[k] += units
				o.limit[k], o.unit[k] = l.Limit, l.Unit
				// The state is known: Redis answers limit − what this test recorded.
				if l.Remaining != l.Limit-o.used[k] {
					t.Fatalf("known state: %v remaining %d, want %d", k, l.Remaining, l.Limit-o.used[k])
				}
				lastSeen[i][k] = l.Remaining
			}
		}
	}
	for _, a := range s.admissions {
		if n := metric(t, a, "quotaflow_admission_decisions_total", "result", "failopen"); n != 0 {
			t.Fatalf("%s decided %v requests without Redis before the outage", a.Name, n)
		}
	}

	s.redis.Close()
	start := time.Now()
	var mu sync.Mutex
	var wg sync.WaitGroup
	errs := make(chan error, 2*len(twoInstUsers)*2)
	for i := range 2 {
		for _, u := range twoInstUsers {
			for w := range 2 {
				wg.Go(func() {
					for n := 0; ; n++ {
						code, _, err := admitAt(s.apis[i], admitReq{RequestID: fmt.Sprintf("out-%d-%s-%d-%d", i, u.user, w, n),
							Tenant: u.tenant, User: u.user, Endpoint: "/v1/chat", Estimate: u.cost})
						switch {
						case err != nil || code != http.StatusOK && code != http.StatusTooManyRequests:
							errs <- fmt.Errorf("instance %d, %s: %d %v", i+1, u.user, code, err)
							return
						case code == http.StatusTooManyRequests:
							return
						}
						mu.Lock()
						for _, k := range []limitKey{{"user", u.tenant, u.user, "day"}, {"user", u.tenant, u.user, "rday"},
							{"tenant", u.tenant, "", "tday"}, {"tenant", u.tenant, "", "trday"}} {
							if o.unit[k] == "tokens" {
								o.admitted[i][k] += u.cost
							} else {
								o.admitted[i][k]++
							}
						}
						mu.Unlock()
					}
				})
			}
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	for _, a := range s.admissions {
		if n := metric(t, a, "quotaflow_admission_decisions_total", "result", "failopen"); n == 0 {
			t.Fatalf("%s made no decision without Redis during the outage", a.Name)
		}
	}

	// The documented bounds, per instance: a request limit's share,
	// ceil(limit ÷ QF_INSTANCES), refilled at share per window; a token
	// quota's remaining Redis last reported to it.
	elapsed := time.Since(start)
	for k, lim := range o.limit {
		for i := range 2 {
			if o.unit[k] == "tokens" {
				o.bound[i][k] = lastSeen[i][k]
				continue
			}
			share := (lim + int64(instances) - 1) / int64(instances)
			o.bound[i][k] = share + share*int64(elapsed)/int64(24*time.Hour)
		}
	}
	return o
}

// admitAt posts an admit to an instance's API, safely from any goroutine.
func admitAt(base string, r admitReq) (int, decision, error) {
	var d decision
	raw, err := json.Marshal(r)
	if err != nil {
		return 0, d, err
	}
	resp, err := httpClient.Post(base+"/v1/admit", "application/json", bytes.NewReader(raw))
	if err != nil {
		return 0, d, err
	}
	defer resp.Body.Close()
	err = json.NewDecoder(resp.Body).Decode(&d)
	return resp.StatusCode, d, err
}
