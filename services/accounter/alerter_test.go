package main

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"quotaflow/internal/alertlog"
	"quotaflow/internal/alertlog/alertlogtest"
	"quotaflow/internal/auth"
	"quotaflow/internal/pgdb"
	"quotaflow/internal/pgtest"
)

// TestAlertsFromAlerter: with the alerter's outbox in a database of its
// own (not the ledger's) and QF_ALERTER_URL set, the console's alerts page
// and GET /v1/alerts show the alerter's alerts, read with the viewer's
// own token, each tenant's token its own tenant's only through both; with
// the alerter down both say so (503), never an empty list.
func TestAlertsFromAlerter(t *testing.T) {
	// The alerter's database and its alerts API, the handler it serves.
	adb, err := pgdb.Open(context.Background(), pgtest.NewDatabase(t, "qf_alerter_db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(adb.Close)
	alertlogtest.Migrate(t, adb)
	at := time.Now().UTC().Add(-time.Hour).Truncate(time.Second)
	alertlogtest.Threshold(t, adb, "acme-80", "acme", "alice", 80, at, "ops")
	alertlogtest.Threshold(t, adb, "acme-90", "acme", "alice", 90, at.Add(time.Minute), "ops", "pager")
	alertlogtest.Threshold(t, adb, "globex-100", "globex", "gina", 100, at.Add(2*time.Minute), "ops")
	tokens := []string{"console-admin#admin", "console-acme@acme"}
	a, err := auth.New(auth.Options{Tokens: tokens})
	if err != nil {
		t.Fatal(err)
	}
	alerter := httptest.NewServer(alertlog.NewHandler(adb, a, nil))
	t.Cleanup(alerter.Close)

	e := newEnv(t) // the ledger's database: no outbox in it
	e.cfg.Tokens.APITokens = tokens
	e.cfg.AlerterURL = alerter.URL
	var consoleAddr string
	e.start(&hooks{console: func(addr string) { consoleAddr = addr }})
	base := "http://" + consoleAddr
	acme, admin := signIn(t, base, "console-acme"), signIn(t, base, "console-admin")

	api := func(tok, tenant string) (int, []string, string) {
		t.Helper()
		req, _ := http.NewRequest("GET", base+"/v1/alerts?tenant="+tenant, nil)
		req.Header.Set("Authorization", "Bearer "+tok)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var body struct {
			alertlog.List
			Detail string
		}
		if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, a := range body.Alerts {
			ids = append(ids, a.ID)
		}
		return resp.StatusCode, ids, body.Detail
	}
	for _, tc := range []struct {
		tok, tenant string
		code        int
		want        []string
	}{
		{"console-acme", "acme", 200, []string{"acme-90", "acme-80"}},
		{"console-acme", "globex", 403, nil},
		{"console-admin", "globex", 200, []string{"globex-100"}},
	} {
		if code, ids, _ := api(tc.tok, tc.tenant); code != tc.code || !slices.Equal(ids, tc.want) {
			t.Errorf("GET /v1/alerts?tenant=%s as %s = %d %v, want %d %v", tc.tenant, tc.tok, code, ids, tc.code, tc.want)
		}
	}
	code, body := get(t, acme, base+"/tenants/acme/alerts")
	if code != 200 || !strings.Contains(body, ">90%<") || !strings.Contains(body, ">80%<") || strings.Contains(body, "gina") {
		t.Errorf("acme's alerts page = %d, want its two alerts and none of globex's:\n%s", code, body)
	}
	if code, body := get(t, acme, base+"/tenants/globex/alerts"); code != 404 || strings.Contains(body, "gina") {
		t.Errorf("acme's token on globex's alerts page = %d, want 404 without globex's data", code)
	}
	if code, body := get(t, admin, base+"/tenants/globex/alerts"); code != 200 || !strings.Contains(body, "gina") || !strings.Contains(body, ">100%<") {
		t.Errorf("admin's globex alerts page = %d, want gina's 100%% alert:\n%s", code, body)
	}

	alerter.Close()
	if code, ids, detail := api("console-acme", "acme"); code != 503 || ids != nil || !strings.Contains(detail, "the alerter (QF_ALERTER_URL) cannot be reached") {
		t.Errorf("alerter down: GET /v1/alerts = %d %v %q, want 503 saying the alerter cannot be reached", code, ids, detail)
	}
	if code, body := get(t, acme, base+"/tenants/acme/alerts"); code != 503 || !strings.Contains(body, "The alerter (QF_ALERTER_URL) cannot be reached") {
		t.Errorf("alerter down: acme's alerts page = %d, want 503 saying the alerter cannot be reached:\n%s", code, body)
	}
}
