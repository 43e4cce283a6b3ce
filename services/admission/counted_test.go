package main

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"quotaflow/internal/natstest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/events"
)

// countedPolicy is a plan of fixed request windows alone (limits.Counted):
// a user's hour, and the tenant's hour across its users.
const countedPolicy = `
default_plan: rpm
plans:
  rpm:
    rates: [{name: hour, kind: fixed, window: 1h, limit: 7}]
tenants:
  TENANT: {rates: [{name: all, kind: fixed, window: 1h, limit: 25}]}
`

// TestCountedPlanOverHTTP: 4 users race with 8 clients each on a plan of
// a user's and a tenant-wide fixed window: exactly the tenant's 25 are
// allowed, no user past its 7, each user's usage is its 200s; the denials
// carry Retry-After; Redis holds counters and no blob of the tenant; the
// reserved events' snapshots number the tenant's requests 1 to 25, each
// with a version.
func TestCountedPlanOverHTTP(t *testing.T) {
	s := newStack(t, countedPolicy, nil)
	const users, clients, each = 4, 8, 2 // 64 requests, 28 by the users' limits, 25 by the tenant's
	var mu sync.Mutex
	ok := map[string]int{}
	codes := map[int]int{}
	var wg sync.WaitGroup
	for u := range users {
		for c := range clients {
			wg.Go(func() {
				for i := range each {
					user := fmt.Sprint("u", u)
					a := s.admit(user, fmt.Sprintf("c%d-%d", c, i), 1)
					if a.code == 429 {
						if r, err := strconv.Atoi(a.hdr.Get("Retry-After")); err != nil || r <= 0 || r > 3600 {
							t.Errorf("429 with Retry-After %q, want 1 to 3600 seconds", a.hdr.Get("Retry-After"))
						}
					}
					mu.Lock()
					codes[a.code]++
					if a.code == 200 {
						ok[user]++
					}
					mu.Unlock()
				}
			})
		}
	}
	wg.Wait()
	if codes[200] != 25 || codes[429] != users*clients*each-25 || len(codes) != 2 {
		t.Fatalf("answers = %v, want exactly 25 × 200 and %d × 429", codes, users*clients*each-25)
	}
	if n := s.failopen(); n != 0 {
		t.Fatalf("%v decisions were made without Redis", n)
	}
	for u := range users {
		user := fmt.Sprint("u", u)
		got := s.call("GET", "/v1/usage?tenant="+s.tenant+"&user="+user, "").body["limits"]
		want := fmt.Sprintf("[map[limit:25 name:all remaining:0 reset_seconds:%%v scope:tenant unit:requests used:25] map[limit:7 name:hour remaining:%d reset_seconds:%%v scope:user unit:requests used:%d]]", 7-ok[user], ok[user])
		lims, _ := got.([]any)
		if ok[user] > 7 || len(lims) != 2 || fmt.Sprintf(want, lims[0].(map[string]any)["reset_seconds"], lims[1].(map[string]any)["reset_seconds"]) != fmt.Sprint(got) {
			t.Errorf("%s: %d allowed, usage %v; want at most 7 and usage of them", user, ok[user], got)
		}
	}
	var keys []string
	it := redistest.Shared(t).Scan(context.Background(), 0, "*{"+s.tenant+"}*", 1000).Iterator()
	for it.Next(context.Background()) {
		keys = append(keys, strings.TrimPrefix(it.Val(), "q{"+s.tenant+"}"))
	}
	slices.Sort(keys)
	if len(keys) != 5 || !strings.HasPrefix(keys[0], "C:") || !strings.HasPrefix(keys[4], "c:u3:") {
		t.Errorf("the tenant's keys are %q, want its counter (C:) and each user's (c:u<n>:), no blob", keys)
	}

	s.close() // flushes the outbox
	var tenantUsed []int
	for _, ev := range natstest.StoredEvents(t, s.js, s.cfg.Stream) {
		r, isReserved := ev.Data.(events.Reserved)
		if !isReserved {
			continue
		}
		if r.Version == 0 || r.TenantVersion != r.Version || len(r.Limits) != 2 || r.Limits[0].Name != "all" {
			t.Fatalf("reserved event %+v: want a version and the two limits", r)
		}
		tenantUsed = append(tenantUsed, int(r.Limits[0].Used))
	}
	slices.Sort(tenantUsed)
	if want := fmt.Sprint(seq(1, 25)); fmt.Sprint(tenantUsed) != want {
		t.Errorf("the reserved events' tenant-wide used = %v, want %s", tenantUsed, want)
	}
}

// seq returns from, from+1, ..., to.
func seq(from, to int) []int {
	var s []int
	for i := from; i <= to; i++ {
		s = append(s, i)
	}
	return s
}

// TestCountedPlanRedisKilled: with Redis gone such a plan is decided
// locally (200 or 429, never a 5xx, counted as failopen), and from Redis's
// counters once it is back.
func TestCountedPlanRedisKilled(t *testing.T) {
	srv := redistest.Start(t)
	// The tenant's room for the rounds that were partly decided locally.
	s := newStackOn(t, srv.Client(), strings.Replace(countedPolicy, "limit: 25", "limit: 1000", 1), nil)
	if a := s.admit("u", "before", 1); a.code != 200 {
		t.Fatalf("admit before the outage = %d %v", a.code, a.body)
	}
	srv.Stop()
	codes := map[int]int{}
	for i := range 40 {
		codes[s.admit(fmt.Sprint("u", i%4), fmt.Sprint("during-", i), 1).code]++
	}
	if codes[200]+codes[429] != 40 || s.failopen() == 0 {
		t.Errorf("answers during the outage = %v, %v failopen; want only 200 and 429, decided locally", codes, s.failopen())
	}
	srv.Restart() // empty: fresh windows (the epoch guard is off here)
	deadline := time.Now().Add(30 * time.Second)
	var user string
	for i := 0; ; i++ {
		before := s.failopen()
		user = fmt.Sprint("after-", i)
		var got []int
		for k := range 8 {
			got = append(got, s.admit(user, fmt.Sprint(k), 1).code)
		}
		if s.failopen() == before {
			if fmt.Sprint(got) != "[200 200 200 200 200 200 200 429]" {
				t.Errorf("after recovery: %v, want 7 × 200 then 429 from Redis", got)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("decisions never came from Redis again")
		}
		time.Sleep(50 * time.Millisecond)
	}
	if n, err := srv.Client().Exists(context.Background(), "q{"+s.tenant+"}u:"+user).Result(); err != nil || n != 0 {
		t.Errorf("a blob of the user exists after recovery (%d, %v), want counters only", n, err)
	}
}
