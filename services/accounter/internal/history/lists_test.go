package history_test

import (
	"context"
	"fmt"
	"net/url"
	"testing"
	"time"

	"quotaflow/services/accounter/internal/history"
	"quotaflow/services/accounter/internal/ledger"
)

// denied writes a denied event: n denials of tenant's user by the limit
// scope/name in the second at.
func (w *world) denied(tenant, user, scope, name string, at time.Time, n int) {
	w.t.Helper()
	id := fmt.Sprintf("den-%s-%s-%s-%d", user, name, at.Format(time.RFC3339), n)
	body := fmt.Sprintf(`{"type":"quotaflow.usage.denied","data":{"tenant":%q,"user":%q,"endpoint":"/gen","scope":%q,"name":%q,"count":%d}}`,
		tenant, user, scope, name, n)
	if _, err := w.store.Write(context.Background(), []ledger.Record{{EventID: id, Kind: "quotaflow.usage.denied", Tenant: tenant,
		User: user, OccurredAt: at, Payload: []byte(body)}}); err != nil {
		w.t.Fatal(err)
	}
}

func TestTopUsers(t *testing.T) {
	w := newWorld(t)
	w.request("acme", "u1", "r1", day0, 100, 40)
	w.request("acme", "u1", "r2", day0.Add(time.Hour), 100, 60)
	w.request("acme", "u2", "r3", day0, 100, 500)
	w.request("acme", "u3", "r4", day0, 100, 100)
	w.request("acme", "u4", "r5", day0.Add(3*time.Hour), 100, 9999) // after the range
	w.request("beta", "u9", "r1", day0, 100, 99999)
	q := url.Values{"tenant": {"acme"}, "from": {day0.Format(time.RFC3339)}, "to": {day0.Add(2 * time.Hour).Format(time.RFC3339)}, "limit": {"2"}}
	var got struct{ Users []history.UserTotal }
	if code := w.get(acmeToken, "/v1/usage/top", q, &got); code != 200 {
		t.Fatalf("status %d", code)
	}
	// u1 and u3 tie at 100 tokens: by user.
	want := []history.UserTotal{{"u2", 500, 1}, {"u1", 100, 2}}
	if fmt.Sprint(got.Users) != fmt.Sprint(want) {
		t.Errorf("top page 1 = %v, want %v", got.Users, want)
	}
	q.Set("offset", "2")
	got.Users = nil
	w.get(acmeToken, "/v1/usage/top", q, &got)
	if want := []history.UserTotal{{"u3", 100, 1}}; fmt.Sprint(got.Users) != fmt.Sprint(want) {
		t.Errorf("top page 2 = %v, want %v", got.Users, want)
	}
	for _, bad := range []url.Values{{"limit": {"501"}}, {"limit": {"0"}}, {"offset": {"-1"}}, {"offset": {"10001"}}, {"step": {"day"}}} {
		q := url.Values{"tenant": {"acme"}, "from": {day0.Format(time.RFC3339)}, "to": {day0.Add(time.Hour).Format(time.RFC3339)}}
		for k, v := range bad {
			q[k] = v
		}
		if code := w.get(adminToken, "/v1/usage/top", q, nil); code != 400 {
			t.Errorf("top with %v = %d, want 400", bad, code)
		}
	}
}

func TestDenials(t *testing.T) {
	w := newWorld(t)
	w.denied("acme", "u1", "user", "rpm", day0.Add(time.Second), 3)
	w.denied("acme", "u2", "user", "rpm", day0.Add(2*time.Second), 4)
	w.denied("acme", "u1", "tenant", "daily", day0.Add(time.Minute), 5)
	w.denied("acme", "u1", "user", "rpm", day0.Add(5*time.Hour), 100) // after the range
	w.denied("beta", "u1", "user", "rpm", day0, 1000)
	w.request("acme", "u1", "r1", day0, 100, 40) // not a denial
	q := url.Values{"tenant": {"acme"}, "from": {day0.Format(time.RFC3339)}, "to": {day0.Add(time.Hour).Format(time.RFC3339)}}
	var got struct{ Denials []history.Denial }
	if code := w.get(acmeToken, "/v1/usage/denials", q, &got); code != 200 {
		t.Fatalf("status %d", code)
	}
	want := []history.Denial{{"user", "rpm", 7}, {"tenant", "daily", 5}}
	if fmt.Sprint(got.Denials) != fmt.Sprint(want) {
		t.Errorf("denials = %v, want %v", got.Denials, want)
	}
}

func TestTenants(t *testing.T) {
	w := newWorld(t)
	for _, ten := range []string{"acme", "beta", "gamma", "delta"} {
		w.request(ten, "u1", "r1", day0, 100, 1)
		w.request(ten, "u2", "r1", day0, 100, 1)
	}
	var got struct{ Tenants []string }
	w.get(adminToken, "/v1/tenants", url.Values{"limit": {"3"}}, &got)
	if fmt.Sprint(got.Tenants) != "[acme beta delta]" {
		t.Errorf("admin's tenants = %v, want [acme beta delta]", got.Tenants)
	}
	w.get(adminToken, "/v1/tenants", url.Values{"limit": {"3"}, "after": {"delta"}}, &got)
	if fmt.Sprint(got.Tenants) != "[gamma]" {
		t.Errorf("admin's tenants after delta = %v, want [gamma]", got.Tenants)
	}
	w.get(acmeToken, "/v1/tenants", nil, &got)
	if fmt.Sprint(got.Tenants) != "[acme]" {
		t.Errorf("acme's tenants = %v, want [acme]", got.Tenants)
	}
	w.get(gatewayToken, "/v1/tenants", nil, &got)
	if len(got.Tenants) != 0 {
		t.Errorf("the gateway's tenants = %v, want none", got.Tenants)
	}
}

// TestAlertsElsewhere: without the alerter's outbox in the ledger's
// database, alerts answer 503, not 500.
func TestAlertsElsewhere(t *testing.T) {
	w := newWorld(t)
	if code := w.get(acmeToken, "/v1/alerts", url.Values{"tenant": {"acme"}}, nil); code != 503 {
		t.Errorf("alerts without an outbox = %d, want 503", code)
	}
}
