package history_test

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"quotaflow/internal/alertlog"
	"quotaflow/internal/alertlog/alertlogtest"
	"quotaflow/internal/auth"
	"quotaflow/internal/pgtest"
	"quotaflow/services/accounter/internal/history"
)

// TestAlertsShared: when the alerter shares the ledger's database, a
// tenant's recent alerts come from its outbox, each once however many
// webhooks it went to, newest first, and never another tenant's.
func TestAlertsShared(t *testing.T) {
	w := newWorld(t)
	alertlogtest.Migrate(t, w.pool)
	alertlogtest.Threshold(t, w.pool, "a1", "acme", "u1", 80, day0, "ops", "pager")
	alertlogtest.Threshold(t, w.pool, "a2", "acme", "u1", 90, day0.Add(time.Minute), "ops", "pager")
	alertlogtest.Threshold(t, w.pool, "a3", "acme", "u2", 100, day0.Add(2*time.Minute), "ops")
	alertlogtest.Threshold(t, w.pool, "b1", "beta", "u1", 80, day0.Add(3*time.Minute), "ops")

	var got struct{ Alerts []alertlog.Alert }
	if code := w.get(acmeToken, "/v1/alerts", url.Values{"tenant": {"acme"}, "limit": {"2"}}, &got); code != 200 {
		t.Fatalf("status %d", code)
	}
	want := []alertlog.Alert{{ID: "a3", At: day0.Add(2 * time.Minute), Kind: "quota.threshold", User: "u2", Limit: "daily", Threshold: 100},
		{ID: "a2", At: day0.Add(time.Minute), Kind: "quota.threshold", User: "u1", Limit: "daily", Threshold: 90}}
	if len(got.Alerts) != 2 {
		t.Fatalf("alerts = %v, want %v", got.Alerts, want)
	}
	for i := range want {
		g := got.Alerts[i]
		g.At = g.At.UTC()
		if g != want[i] {
			t.Errorf("alert %d = %+v, want %+v", i, g, want[i])
		}
	}
	w.get(acmeToken, "/v1/alerts", url.Values{"tenant": {"acme"}, "limit": {"2"}, "offset": {"2"}}, &got)
	if len(got.Alerts) != 1 || got.Alerts[0].ID != "a1" {
		t.Errorf("page 2 = %v, want a1 alone", got.Alerts)
	}
	if code := w.get(acmeToken, "/v1/alerts", url.Values{"tenant": {"beta"}}, nil); code != 403 {
		t.Errorf("acme's token for beta's alerts = %d, want 403", code)
	}
}

// TestAlertsForwarded: with the alerts read from the alerter's API, the
// accounter presents the viewer's own token (its header, or its console
// cookie's): an alerter that knows only the admin's token serves the admin
// and refuses acme's, which the accounter answers 502 with the alerter's
// reason.
func TestAlertsForwarded(t *testing.T) {
	adb := pgtest.Pool(t, "alerterdb", func(context.Context, *pgxpool.Pool, *slog.Logger) error { return nil })
	alertlogtest.Migrate(t, adb)
	alertlogtest.Threshold(t, adb, "a1", "acme", "u1", 80, day0, "ops")
	onlyAdmin, err := auth.New(auth.Options{Tokens: []string{adminToken + "#admin"}})
	if err != nil {
		t.Fatal(err)
	}
	alerter := httptest.NewServer(alertlog.NewHandler(adb, onlyAdmin, nil))
	t.Cleanup(alerter.Close)
	c, err := alertlog.NewClient(alerter.URL, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	w := newWorld(t)
	a, err := auth.New(auth.Options{Tokens: []string{adminToken + "#admin", acmeToken + "@acme#gateway"}})
	if err != nil {
		t.Fatal(err)
	}
	w.srv = httptest.NewServer(history.NewHandler(history.Options{Reader: history.NewReader(w.pool, 0, history.WindowsSource{Limiter: w.lim, Policy: w.pol.Load}), Alerts: history.Alerter{Client: c}, Auth: a}))
	t.Cleanup(w.srv.Close)

	var got alertlog.List
	if code := w.get(adminToken, "/v1/alerts", url.Values{"tenant": {"acme"}}, &got); code != 200 || len(got.Alerts) != 1 || got.Alerts[0].ID != "a1" {
		t.Errorf("admin's alerts = %d %v, want 200 [a1]", code, got.Alerts)
	}
	// The alerter takes every page the accounter does: the largest, deepest.
	deepest := url.Values{"tenant": {"acme"}, "limit": {strconv.Itoa(history.MaxLimit)}, "offset": {strconv.Itoa(history.MaxOffset)}}
	var deep alertlog.List
	if code := w.get(adminToken, "/v1/alerts", deepest, &deep); code != 200 || deep.Alerts == nil || len(deep.Alerts) != 0 {
		t.Errorf("admin's deepest page of alerts = %d %v, want 200 []", code, deep.Alerts)
	}
	for _, tc := range []struct {
		name string
		set  func(*http.Request)
		code int
		says string
	}{
		{"acme's token, one the alerter does not know", func(r *http.Request) { r.Header.Set("Authorization", "Bearer "+acmeToken) },
			502, "401 Unauthorized: a known token is required"},
		{"the admin's console cookie", func(r *http.Request) { r.AddCookie(&http.Cookie{Name: history.CookieName, Value: adminToken}) },
			200, `"id":"a1"`},
	} {
		req, _ := http.NewRequest("GET", w.srv.URL+"/v1/alerts?tenant=acme", nil)
		tc.set(req)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tc.code || !strings.Contains(string(body), tc.says) {
			t.Errorf("%s: GET /v1/alerts = %d %s, want %d saying %q", tc.name, resp.StatusCode, body, tc.code, tc.says)
		}
	}
}
