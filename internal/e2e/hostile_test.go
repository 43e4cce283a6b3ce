package e2e_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"quotaflow/internal/e2e"
	"quotaflow/internal/natstest"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

// The hostile-caller suite (issue 11, "Trust"): callers that use the API
// carelessly or on purpose the wrong way, against admission and the
// accounter run as processes on real servers. Each subtest owns its
// tenants and checks what a client sees and what is left in Redis and the
// ledger. They run one after another on one stack: the reconciliation
// checks read the accounter's drift and repair metrics, which cover every
// subject of its Redis.

// hostilePolicy has a plan or tenant per subtest (named after it).
const hostilePolicy = `
default_plan: basic
plans:
  basic:
    quotas: [{name: 5h, kind: rolling, window: 5h, limit: 100000}]
  reuse:
    quotas: [{name: 5h, kind: rolling, window: 5h, limit: 100000}]
    rates:  [{name: rpm, kind: sliding_log, window: 1m, limit: 3}]
  # distinct names: a user's counters are keyed by the limit, not the
  # plan, so plans' limits of one name and window share one counter
  free:
    quotas: [{name: free5h, kind: rolling, window: 5h, limit: 1000}]
  team:
    quotas: [{name: team5h, kind: rolling, window: 5h, limit: 2000}]
  enterprise:
    quotas: [{name: ent5h, kind: rolling, window: 5h, limit: 5000}]
  prepaid:
    quotas: [{name: credits, kind: balance}]
  alt:
    quotas: [{name: alt5h, kind: rolling, window: 5h, limit: 1000}]
  huge:
    quotas: [{name: 5h, kind: rolling, window: 5h, limit: 1000000000000}]
tenants:
  reuse:    {plan: reuse}
  planpick: {plan: free, plans: [team]}
  gamma:    {plan: prepaid}
  rel:      {plan: basic, plans: [alt]}
  slots:    {rates: [{name: inflight, kind: concurrency, limit: 2}]}
  huge:     {plan: huge}
endpoints:
  /v1/slot:
    user: [{name: inflight, kind: concurrency, limit: 1}]
`

// hostile's tokens: the platform's own gateway (bound to no tenant: any
// tenant, any plan), the billing service, and a gateway token per tenant
// that has one.
type hostileTokens struct {
	gateway, billing             string
	planpick, gamma, ta, tb, rel string
	entries                      []string
}

func newHostileTokens() hostileTokens {
	tk := hostileTokens{
		gateway: "gw-" + e2e.RandomHex(8), billing: "billing-" + e2e.RandomHex(8),
		planpick: "planpick-" + e2e.RandomHex(8), gamma: "gamma-" + e2e.RandomHex(8),
		ta: "ta-" + e2e.RandomHex(8), tb: "tb-" + e2e.RandomHex(8), rel: "rel-" + e2e.RandomHex(8),
	}
	tk.entries = []string{tk.gateway, tk.billing + "#billing",
		tk.planpick + "@planpick", tk.gamma + "@gamma", tk.ta + "@ta", tk.tb + "@tb", tk.rel + "@rel"}
	return tk
}

func TestHostile(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the services and runs them against the real servers")
	}
	t.Parallel() // with TestHostileSlowReserve: each runs a stack of its own
	tk := newHostileTokens()
	s := startStack(t, stackConfig{
		policy: hostilePolicy,
		tokens: tk.entries,
		// A loaded machine answers Redis in more than the default 10 ms
		// at times; these tests want Redis's exact decisions.
		admission: []string{"QF_REDIS_TIMEOUT=250ms"},
		accounter: []string{"QF_RECONCILE_INTERVAL=500ms"},
	})
	gw := func(t *testing.T) caller { return s.as(t, tk.gateway) }

	t.Run("ReusedRequestID", func(t *testing.T) { testReusedRequestID(t, s, gw(t)) })
	t.Run("ReleaseKeepsActualUsage", func(t *testing.T) { testReleaseKeepsActualUsage(t, s, gw(t)) })
	t.Run("TenantTokenPlans", func(t *testing.T) { testTenantTokenPlans(t, gw(t), s.as(t, tk.planpick)) })
	t.Run("TenantTokenTopUp", func(t *testing.T) {
		testTenantTokenTopUp(t, gw(t), s.as(t, tk.gamma), s.as(t, tk.billing))
	})
	t.Run("CrossTenantEventIDs", func(t *testing.T) {
		testCrossTenantEventIDs(t, s, gw(t), s.as(t, tk.ta), s.as(t, tk.tb))
	})
	t.Run("ControlCharacters", func(t *testing.T) { testControlCharacters(t, s, gw(t)) })
	t.Run("EventTime", func(t *testing.T) { testEventTime(t, s, gw(t)) })
	t.Run("ReleaseRules", func(t *testing.T) { testReleaseRules(t, s, s.as(t, tk.rel)) })
	t.Run("SlotCollisions", func(t *testing.T) { testSlotCollisions(t, s, gw(t)) })
	t.Run("AuthErrorsSayNothing", func(t *testing.T) {
		testAuthErrorsSayNothing(t, s, s.as(t, tk.planpick), s.as(t, tk.gamma))
	})
	// Last: its windows stay saturated for hours, so a fault in how the
	// reconciliation treats them would show in every later drift check.
	t.Run("Overflow", func(t *testing.T) { testOverflow(t, s, gw(t)) })
}

// conflict checks that r is the 409 of a taken request id.
func conflict(t *testing.T, what string, r reply) {
	t.Helper()
	if r.code != http.StatusConflict || !bytes.Contains(r.body, []byte(`"message":"request_id: `)) {
		t.Errorf("%s = %s, want 409 {\"code\":409,\"message\":\"request_id: ...\"}", what, r)
	}
}

// releaseGivesBack releases id as c and returns the reply once the
// reservation is given back. The contract (design §4) has two answers:
// 200 released (given back now) or, when admission's Redis call failed
// (a timeout on a loaded machine), 202 queued, the accounter giving it
// back when it consumes the released event; then it waits until the
// ledger marks the reservation released, which the accounter does only
// after giving it back in Redis. Any other answer, or a queued release
// never given back, fails the test.
func (s *stack) releaseGivesBack(t *testing.T, c caller, tenant, user, id string) reply {
	t.Helper()
	r, st := c.release(tenant, user, id)
	switch {
	case st == "released":
		return r
	case r.code != http.StatusAccepted || !bytes.Contains(r.body, []byte(`"status":"queued"`)):
		t.Fatalf("release %s = %s, want 200 released or 202 queued", id, r)
	}
	e2e.EventuallyLast(t, "the queued release of "+id+" given back by the accounter", func() (bool, string) {
		st, _ := s.reservation(t, tenant, user, id)
		return st == "released", fmt.Sprintf("reservation %q", st)
	})
	return r
}

// authzDenial reports whether r is a /v1/authz denial for reason: the deny
// status (429 by default), X-Quota-Denied: 1 and the reason in the body.
func authzDenial(t *testing.T, r reply, reason string) bool {
	t.Helper()
	if r.code != http.StatusTooManyRequests || r.hdr.Get("X-Quota-Denied") != "1" {
		return false
	}
	var d decision
	r.decode(t, &d)
	return d.Reason == reason
}

// Item 1: a request id is an idempotency key only while its reservation is
// open and only for the same request; after its release it is taken.
func testReusedRequestID(t *testing.T, s *stack, gw caller) {
	const tenant, user, ep = "reuse", "u1", "/v1/chat"
	admit := func(id string, cost int64) reply {
		return gw.admit(admitReq{RequestID: id, Tenant: tenant, User: user, Endpoint: ep, Estimate: cost})
	}
	admitted := 0
	count := func(r reply) reply {
		if r.code == http.StatusOK {
			admitted++
		}
		return r
	}
	if r := count(admit("r1", 10)); r.code != http.StatusOK {
		t.Fatalf("admit r1 = %s, want 200", r)
	}
	s.releaseGivesBack(t, gw, tenant, user, "r1")
	for i := range 3 {
		conflict(t, fmt.Sprintf("admit of the released r1, try %d", i+1), count(admit("r1", 10)))
	}
	conflict(t, "admit of the released r1 with a larger cost", count(admit("r1", 500)))
	if u := gw.usage(tenant, user, ""); u["rpm"].Used != 1 || u["5h"].Used != 0 {
		t.Errorf("after the reuses: rpm used %d, 5h used %d; want 1 and 0 (the reuses reserve nothing)", u["rpm"].Used, u["5h"].Used)
	}

	// An identical retry of an open reservation is the stored decision;
	// the same id with another cost is taken.
	if r := count(admit("r2", 20)); r.code != http.StatusOK {
		t.Fatalf("admit r2 = %s, want 200", r)
	}
	if r := admit("r2", 20); r.code != http.StatusOK {
		t.Errorf("identical retry of the open r2 = %s, want 200 (its stored decision)", r)
	}
	conflict(t, "admit of the open r2 with a larger cost", count(admit("r2", 900)))
	if u := gw.usage(tenant, user, ""); u["rpm"].Used != 2 || u["5h"].Used != 20 {
		t.Errorf("after r2 and its retries: rpm used %d, 5h used %d; want 2 and 20", u["rpm"].Used, u["5h"].Used)
	}
	for _, id := range []string{"r3", "r4", "r5"} {
		count(admit(id, 1))
	}
	if admitted != 3 {
		t.Errorf("%d admits allowed under a limit of 3 requests a minute, want 3", admitted)
	}

	// /v1/authz: every call is a new upstream request, so an id that any
	// reservation holds, open or settled, is denied, never replayed.
	const authzUser = "u-authz"
	authz := func(id string) reply {
		return gw.do(http.MethodGet, "/v1/authz", nil, "X-Quota-Tenant", tenant, "X-Quota-User", authzUser,
			"X-Quota-Estimated-Tokens", "5", "X-Original-URI", ep, "X-Request-Id", id)
	}
	if r := authz("a1"); r.code != http.StatusOK {
		t.Fatalf("authz a1 = %s, want 200", r)
	}
	if r := gw.admit(admitReq{RequestID: "a2", Tenant: tenant, User: authzUser, Endpoint: ep, Estimate: 5}); r.code != http.StatusOK {
		t.Fatalf("admit a2 = %s, want 200", r)
	}
	reused := func(what, id string) {
		t.Helper()
		if r := authz(id); !authzDenial(t, r, "request_id_reused") {
			t.Errorf("authz with the %s id %s = %s (X-Quota-Denied %q), want 429 reason request_id_reused, X-Quota-Denied: 1",
				what, id, r, r.hdr.Get("X-Quota-Denied"))
		}
	}
	before := gw.usage(tenant, authzUser, "")
	reused("open", "a1")
	reused("open", "a2")
	if after := gw.usage(tenant, authzUser, ""); after["5h"] != before["5h"] || after["rpm"] != before["rpm"] {
		t.Errorf("denied reuses on authz moved the limits from %+v to %+v", before, after)
	}
	s.releaseGivesBack(t, gw, tenant, authzUser, "a2")
	reused("released", "a2")
}

// Item 2: a release does not erase the actual usage reported for the
// request, whichever comes first; Redis, the ledger and the rollups agree,
// so the reconciliation finds nothing to repair.
func testReleaseKeepsActualUsage(t *testing.T, s *stack, gw caller) {
	const tenant = "settle"
	repaired0 := s.repaired(t)
	admit := func(user, id string) {
		t.Helper()
		if r := gw.admit(admitReq{RequestID: id, Tenant: tenant, User: user, Endpoint: "/v1/chat", Estimate: 100}); r.code != http.StatusOK {
			t.Fatalf("admit %s = %s, want 200", id, r)
		}
	}
	reportActual := func(user, id string) {
		t.Helper()
		if r := gw.report(actualEvent("evt-"+id, tenant, user, id, 20, 30, time.Now())); r.code != http.StatusAccepted {
			t.Fatalf("report the actual of %s = %s, want 202", id, r)
		}
	}
	settled := func(user, id string) {
		t.Helper()
		e2e.EventuallyLast(t, id+" settled at 50 in the ledger and in Redis", func() (bool, string) {
			st, actual := s.reservation(t, tenant, user, id)
			n, tokens := s.actuals(t, tenant, user)
			used := gw.used(tenant, user, "", "5h")
			return st == "settled" && actual == 50 && n == 1 && tokens == 50 && used == 50,
				fmt.Sprintf("reservation %q actual %d; %d actual events, %d tokens; Redis 5h used %d", st, actual, n, tokens, used)
		})
		if r := s.count(t, `SELECT coalesce(sum(tokens), 0)::bigint FROM usage_rollups WHERE tenant = $1 AND user_id = $2`, tenant, user); r != 50 {
			t.Errorf("rollups of %s hold %d tokens, want 50", user, r)
		}
	}

	// Release, then the actual: charged in full.
	admit("u1", "r1")
	s.releaseGivesBack(t, gw, tenant, "u1", "r1")
	reportActual("u1", "r1")
	settled("u1", "r1")

	// The actual, then a release: the release changes nothing.
	admit("u2", "r2")
	reportActual("u2", "r2")
	settled("u2", "r2")
	// Queued (admission's Redis call failed) is the contract's other
	// answer: the accounter then finds the row settled and changes nothing,
	// which the checks below and after the reconciliation see.
	if r, st := gw.release(tenant, "u2", "r2"); st != "already_settled" && (r.code != http.StatusAccepted || !bytes.Contains(r.body, []byte(`"status":"queued"`))) {
		t.Errorf("release after the actual = %s, want already_settled or 202 queued", r)
	}
	settled("u2", "r2")

	s.reconcilesClean(t, repaired0)
	for _, u := range []string{"u1", "u2"} {
		if used := gw.used(tenant, u, "", "5h"); used != 50 {
			t.Errorf("after reconciliation %s's 5h holds %d, want 50", u, used)
		}
	}
}

// Item 3: a token bound to a tenant names only the plans the policy grants
// the tenant.
func testTenantTokenPlans(t *testing.T, gw, bound caller) {
	const tenant = "planpick"
	r := bound.admit(admitReq{RequestID: "r1", Tenant: tenant, User: "u1", Plan: "enterprise", Endpoint: "/v1/chat", Estimate: 5000})
	if r.code != http.StatusForbidden {
		t.Errorf("admit on plan enterprise with %s's token = %s, want 403", tenant, r)
	}
	if used := gw.used(tenant, "u1", "enterprise", "ent5h"); used != 0 {
		t.Errorf("enterprise 5h of %s/u1 holds %d after the 403, want 0", tenant, used)
	}
	for _, plan := range []string{"team", "free", ""} {
		id := "r-" + plan
		if r := bound.admit(admitReq{RequestID: id, Tenant: tenant, User: "u1", Plan: plan, Endpoint: "/v1/chat", Estimate: 100}); r.code != http.StatusOK {
			t.Errorf("admit on plan %q (granted, or the tenant's own) = %s, want 200", plan, r)
		}
	}
	if used := gw.used(tenant, "u1", "team", "team5h"); used != 100 {
		t.Errorf("team 5h of %s/u1 holds %d, want 100", tenant, used)
	}
}

// Item 4: a gateway token bound to a tenant cannot add credits; the
// billing service's token can.
func testTenantTokenTopUp(t *testing.T, gw, bound, billing caller) {
	const tenant, user = "gamma", "u1"
	balance := func() int64 {
		t.Helper()
		l, ok := gw.usage(tenant, user, "")["credits"]
		if !ok {
			t.Fatalf("GET /v1/usage of %s/%s has no credits limit", tenant, user)
		}
		return l.Remaining
	}
	before := balance()
	topUp := func(c caller, ref string) reply {
		return c.do(http.MethodPost, "/v1/balances/topup", map[string]any{"tenant": tenant, "user": user, "amount": 1000000, "reference": ref})
	}
	if r := topUp(bound, "pay-1"); r.code != http.StatusForbidden {
		t.Errorf("top-up with %s's gateway token = %s, want 403", tenant, r)
	}
	if b := balance(); b != before {
		t.Errorf("balance after the refused top-up = %d, want %d", b, before)
	}
	if r := bound.admit(admitReq{RequestID: "r1", Tenant: tenant, User: user, Endpoint: "/v1/chat", Estimate: 1000}); r.code != http.StatusTooManyRequests {
		t.Errorf("admit on the empty balance = %s, want 429", r)
	}
	if r := topUp(billing, "pay-2"); r.code != http.StatusOK {
		t.Fatalf("top-up with the billing token = %s, want 200", r)
	}
	if b := balance(); b != before+1000000 {
		t.Errorf("balance after the billing top-up = %d, want %d", b, before+1000000)
	}
}

// Item 5: event ids are the caller's no more, so tenant A cannot claim the
// id of tenant B's event and drop it.
func testCrossTenantEventIDs(t *testing.T, s *stack, gw, a, b caller) {
	const id, user, rid = "evt-shared", "u1", "r1"
	if r := a.report(actualEvent(id, "ta", user, rid, 30, 0, time.Now())); r.code != http.StatusAccepted {
		t.Fatalf("tenant ta reports = %s, want 202", r)
	}
	if r := b.report(actualEvent(id, "tb", user, rid, 40, 0, time.Now())); r.code != http.StatusAccepted {
		t.Fatalf("tenant tb reports = %s, want 202", r)
	}
	for tenant, want := range map[string]int64{"ta": 30, "tb": 40} {
		e2e.EventuallyLast(t, "tenant "+tenant+"'s event in the ledger and in Redis", func() (bool, string) {
			n, tokens := s.actuals(t, tenant, user)
			used := gw.used(tenant, user, "", "5h")
			return n == 1 && tokens == want && used == want,
				fmt.Sprintf("%d actual events, %d tokens; Redis 5h used %d; want %d", n, tokens, used, want)
		})
	}
}

// Item 6: identifiers with NUL or other control characters are refused at
// every door, and an event carrying one is dead-lettered once while the
// consumer goes on.
func testControlCharacters(t *testing.T, s *stack, gw caller) {
	const tenant = "ctl"
	fields := []struct {
		name string
		set  func(*admitReq, string)
	}{
		{"tenant", func(r *admitReq, v string) { r.Tenant = v }},
		{"user", func(r *admitReq, v string) { r.User = v }},
		{"endpoint", func(r *admitReq, v string) { r.Endpoint = v }},
		{"request_id", func(r *admitReq, v string) { r.RequestID = v }},
		{"plan", func(r *admitReq, v string) { r.Plan = v }},
	}
	for _, bad := range []string{"a\x00b", "a\x01b", "a\x1bb", "a\x7fb", "a\u0085b"} {
		for _, f := range fields {
			req := admitReq{RequestID: "r1", Tenant: tenant, User: "u1", Endpoint: "/v1/chat", Estimate: 1}
			f.set(&req, bad)
			want := f.name + ": contains a control character"
			if r := gw.admit(req); r.code != http.StatusBadRequest || !bytes.Contains(r.body, []byte(want)) {
				t.Errorf("admit with %s %q = %s, want 400 %q", f.name, bad, r, want)
			}
		}
	}

	// Go's client refuses to send ASCII controls in a header; a C1 control
	// and a percent-encoded NUL in the original URI are what a client can
	// get through a gateway.
	for _, hdr := range [][]string{
		{"X-Quota-User", "a\u0085b", "X-Original-URI", "/v1/chat"},
		{"X-Quota-User", "u1", "X-Original-URI", "/v1/a%00b"},
		{"X-Quota-User", "u1", "X-Original-URI", "/v1/a%1Fb"},
	} {
		r := gw.do(http.MethodGet, "/v1/authz", nil, append([]string{"X-Quota-Tenant", tenant, "X-Quota-Estimated-Tokens", "1"}, hdr...)...)
		if !authzDenial(t, r, "invalid_request") {
			t.Errorf("authz with %q = %s, want the deny status 429 with reason invalid_request and X-Quota-Denied: 1", hdr, r)
		}
	}
	if u := gw.usage(tenant, "u1", ""); u["5h"].Used != 0 {
		t.Errorf("the refused requests left %d tokens in %s/u1's 5h, want 0", u["5h"].Used, tenant)
	}

	// Published straight to NATS (publishers there are trusted, but an
	// event that can never be valid must not stop a consumer).
	retries0 := s.retries(t)
	bad := fmt.Appendf(nil, `{"specversion":"1.0","id":"evt-nul","source":"hostile-test","type":%q,"time":%q,
"datacontenttype":"application/json","data":{"request_id":"r-nul","tenant":%q,"user":"a\u0000b","input_tokens":10,"output_tokens":0}}`,
		events.TypeActual, time.Now().UTC().Format(time.RFC3339), tenant)
	s.publishRaw(t, events.TypeActual, "evt-nul", bad)
	good, _ := json.Marshal(actualEvent("evt-after-nul", tenant, "u2", "r-after", 7, 0, time.Now()))
	s.publishRaw(t, events.TypeActual, "evt-after-nul", good)
	e2e.EventuallyLast(t, "the event after the NUL one consumed", func() (bool, string) {
		n, tokens := s.actuals(t, tenant, "u2")
		return n == 1 && tokens == 7, fmt.Sprintf("%d actual events of u2, %d tokens", n, tokens)
	})
	s.deadLetteredOnce(t, "evt-nul", stream.ReasonInvalid)
	if n := s.count(t, `SELECT (SELECT count(*) FROM usage_events WHERE tenant = $1 AND user_id <> 'u2') +
		(SELECT count(*) FROM reservations WHERE tenant = $1 AND user_id <> 'u2')`, tenant); n != 0 {
		t.Errorf("the ledger holds %d events of the NUL subject, want 0", n)
	}
	if r := s.retries(t); r != retries0 {
		t.Errorf("the consumer retried %v times, want 0 (an invalid event is dead-lettered at once)", r-retries0)
	}
}

// Item 8: an actual's time is bounded, so a date in 2000 can neither be
// reported nor, published on NATS, make the reconciliation take its charge
// back.
func testEventTime(t *testing.T, s *stack, gw caller) {
	const tenant, user = "time", "u1"
	old := time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)
	if r := gw.report(actualEvent("evt-2000", tenant, user, "r0", 50, 0, old)); r.code != http.StatusBadRequest || !bytes.Contains(r.body, []byte("time")) {
		t.Errorf("report of an actual from 2000 = %s, want 400 naming the time", r)
	}
	repaired0 := s.repaired(t)
	if r := gw.admit(admitReq{RequestID: "r1", Tenant: tenant, User: user, Endpoint: "/v1/chat", Estimate: 100}); r.code != http.StatusOK {
		t.Fatalf("admit r1 = %s, want 200", r)
	}
	e2e.EventuallyLast(t, "r1's reservation in the ledger", func() (bool, string) {
		st, _ := s.reservation(t, tenant, user, "r1")
		return st == "open", fmt.Sprintf("status %q", st)
	})
	raw, _ := json.Marshal(actualEvent("evt-2000-nats", tenant, user, "r1", 50, 0, old))
	s.publishRaw(t, events.TypeActual, "evt-2000-nats", raw)
	s.deadLetteredOnce(t, "evt-2000-nats", stream.ReasonInvalid)
	check := func(when string) {
		t.Helper()
		if used := gw.used(tenant, user, "", "5h"); used != 100 {
			t.Errorf("%s: 5h holds %d, want 100 (the estimate; the actual from 2000 charges nothing)", when, used)
		}
		if st, actual := s.reservation(t, tenant, user, "r1"); st != "open" || actual != -1 {
			t.Errorf("%s: reservation r1 is %q with actual %d, want open with none", when, st, actual)
		}
	}
	check("after the dead letter")
	s.reconcilesClean(t, repaired0)
	check("after reconciliation")
}

// Item 9: a release gives back what the admit reserved, under the plan and
// endpoint it was admitted on, not the tenant's default plan.
func testReleaseRules(t *testing.T, s *stack, bound caller) {
	const tenant, user, ep = "rel", "u1", "/v1/slot"
	admit := func(id string) reply {
		return bound.admit(admitReq{RequestID: id, Tenant: tenant, User: user, Plan: "alt", Endpoint: ep, Estimate: 300})
	}
	if r := admit("r1"); r.code != http.StatusOK {
		t.Fatalf("admit r1 on plan alt = %s, want 200", r)
	}
	if r := admit("r2"); r.code != http.StatusTooManyRequests {
		t.Fatalf("admit r2 while r1 holds the endpoint's one slot = %s, want 429", r)
	}
	// A queued release says nothing of what it gave back: the quota below does.
	if r := s.releaseGivesBack(t, bound, tenant, user, "r1"); r.code == http.StatusOK && !bytes.Contains(r.body, []byte(`"returned_tokens":300`)) {
		t.Fatalf("release r1 = %s, want released with 300 tokens returned", r)
	}
	if used := bound.used(tenant, user, "alt", "alt5h"); used != 0 {
		t.Errorf("plan alt's quota holds %d after r1's release, want 0 (its estimate came back)", used)
	}
	if r := admit("r3"); r.code != http.StatusOK {
		t.Errorf("admit r3 right after r1's release = %s, want 200 (the slot is free)", r)
	}
}

// Item 10: two users' requests with the same id hold a tenant-wide
// concurrency slot each.
func testSlotCollisions(t *testing.T, s *stack, gw caller) {
	const tenant = "slots"
	admit := func(user, id string) reply {
		return gw.admit(admitReq{RequestID: id, Tenant: tenant, User: user, Endpoint: "/v1/chat", Estimate: 1})
	}
	for _, u := range []string{"u1", "u2"} {
		if r := admit(u, "same"); r.code != http.StatusOK {
			t.Fatalf("admit %s/same = %s, want 200", u, r)
		}
	}
	if r := admit("u3", "other"); r.code != http.StatusTooManyRequests {
		t.Errorf("admit u3 while u1 and u2 hold both slots = %s, want 429", r)
	}
	if used := gw.used(tenant, "u1", "", "inflight"); used != 2 {
		t.Errorf("inflight holds %d, want 2", used)
	}
	s.releaseGivesBack(t, gw, tenant, "u1", "same")
	if used := gw.used(tenant, "u1", "", "inflight"); used != 1 {
		t.Errorf("inflight holds %d after u1's release, want 1 (u2's)", used)
	}
	if r := admit("u3", "other2"); r.code != http.StatusOK {
		t.Errorf("admit u3 after u1's release = %s, want 200", r)
	}
	if r := admit("u4", "other3"); r.code != http.StatusTooManyRequests {
		t.Errorf("admit u4 while u2 and u3 hold both slots = %s, want 429 (u2's slot is still held)", r)
	}
}

// 401 and 403 bodies never say which part was wrong.
func testAuthErrorsSayNothing(t *testing.T, s *stack, bound, gammaGateway caller) {
	unauthorized := []reply{
		s.as(t, "").admit(admitReq{Tenant: "planpick", User: "u1", Endpoint: "/v1/chat"}),
		s.as(t, "no-such-token").admit(admitReq{Tenant: "planpick", User: "u1", Endpoint: "/v1/chat"}),
		s.as(t, bound.token+"x").admit(admitReq{Tenant: "planpick", User: "u1", Endpoint: "/v1/chat"}),
	}
	forbidden := []reply{
		bound.admit(admitReq{Tenant: "gamma", User: "u1", Endpoint: "/v1/chat"}),                  // another tenant
		bound.admit(admitReq{Tenant: "planpick", User: "u1", Plan: "huge", Endpoint: "/v1/chat"}), // a plan not granted
		gammaGateway.do(http.MethodPost, "/v1/balances/topup",
			map[string]any{"tenant": "gamma", "user": "u1", "amount": 5, "reference": "p"}), // a role it lacks
	}
	same := func(code int, rs []reply) {
		t.Helper()
		for i, r := range rs {
			if r.code != code || !bytes.Equal(r.body, rs[0].body) {
				t.Errorf("case %d = %s; want %d with the same body as case 0 (%s)", i, r, code, bytes.TrimSpace(rs[0].body))
			}
		}
	}
	same(http.StatusUnauthorized, unauthorized)
	same(http.StatusForbidden, forbidden)
	for _, r := range append(unauthorized, forbidden...) {
		if b := strings.ToLower(string(r.body)); strings.Contains(b, "tenant") || strings.Contains(b, "plan") || strings.Contains(b, "role") {
			t.Errorf("%s names what was wrong", r)
		}
	}
}

// Item 7: counters saturate at 10^12, the cap of every count in the events,
// so every snapshot stays encodable: answers stay within bounds, the
// accounter publishes its corrections instead of redelivering them, and
// the reconciliation keeps working.
func testOverflow(t *testing.T, s *stack, gw caller) {
	const tenant, user = "huge", "u1"
	const maxCount = events.MaxCount
	bounded := func(what string, ls []limitState) {
		t.Helper()
		for _, l := range ls {
			if l.Used < 0 || l.Used > maxCount || l.Remaining < 0 || l.Remaining > l.Limit {
				t.Errorf("%s: limit %s used %d, remaining %d of %d; want 0 <= used <= 10^12, 0 <= remaining <= limit",
					what, l.Name, l.Used, l.Remaining, l.Limit)
			}
		}
	}
	admit := func(id string, cost int64, want int) {
		t.Helper()
		r := gw.admit(admitReq{RequestID: id, Tenant: tenant, User: user, Endpoint: "/v1/chat", Estimate: cost})
		var d decision
		r.decode(t, &d)
		if r.code != want {
			t.Errorf("admit %s of %d = %s, want %d", id, cost, r, want)
		}
		bounded("admit "+id, d.Limits)
	}
	usage := func(what string) {
		t.Helper()
		u := gw.usage(tenant, user, "")
		var ls []limitState
		for _, l := range u {
			ls = append(ls, l)
		}
		bounded(what, ls)
	}
	retries0, dead0, repaired0 := s.retries(t), len(s.deadLetters(t)), s.repaired(t)

	admit("o1", maxCount, http.StatusOK)
	admit("o2", maxCount, http.StatusTooManyRequests)
	// o1 used twice its estimate, and many requests admission never saw
	// used 10^12 each: 2^47 (the 48-bit buckets' bound) is about 141 of
	// them.
	evs := []map[string]any{actualEvent("evt-o1", tenant, user, "o1", maxCount, maxCount, time.Now())}
	const unseen = 150
	for i := range unseen {
		id := fmt.Sprintf("x%03d", i)
		evs = append(evs, actualEvent("evt-"+id, tenant, user, id, maxCount, 0, time.Now()))
	}
	for len(evs) > 0 { // bodies stay under admission's 64 KiB
		n := min(len(evs), 100)
		if r := gw.report(evs[:n]...); r.code != http.StatusAccepted {
			t.Fatalf("report %d actuals = %s, want 202", n, r)
		}
		evs = evs[n:]
	}
	e2e.EventuallyLast(t, "every actual in the ledger", func() (bool, string) {
		n, _ := s.actuals(t, tenant, user)
		return n == unseen+1, fmt.Sprintf("%d actual events", n)
	})
	usage("after the actuals")
	// A reserve on the saturated windows: its reserved event is encodable
	// too, so it reaches the ledger.
	admit("o3", 0, http.StatusOK)
	e2e.EventuallyLast(t, "o3's reserved event in the ledger", func() (bool, string) {
		st, _ := s.reservation(t, tenant, user, "o3")
		return st == "open", fmt.Sprintf("status %q", st)
	})
	e2e.EventuallyLast(t, "a corrected event published for every actual", func() (bool, string) {
		// Count event ids, not messages: the accounter publishes batches.
		evs, err := natstest.ReadStoredEvents(s.js, s.streams.Stream)
		if err != nil {
			return false, err.Error()
		}
		ids := map[string]bool{}
		for _, ev := range evs {
			if c, ok := ev.Data.(events.Corrected); ok && c.Tenant == tenant {
				ids[ev.ID] = true
			}
		}
		return len(ids) == unseen+1, fmt.Sprintf("%d corrected events", len(ids))
	})
	if r := s.retries(t); r != retries0 {
		t.Errorf("the consumer retried %v times, want 0", r-retries0)
	}
	if n := len(s.deadLetters(t)); n != dead0 {
		t.Errorf("%d events dead-lettered, want none", n-dead0)
	}

	// Redis holds the cap, the ledger 151 times as much: they agree.
	s.reconcilesClean(t, repaired0)
	usage("after reconciliation")
}
