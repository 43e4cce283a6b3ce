package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"testing"
	"time"

	"quotaflow/internal/alertlog"
	"quotaflow/internal/e2e"
	"quotaflow/services/alerter/internal/detect"
)

// TestAlertsAPI: the alerter serves the alerts it raised on QF_ALERTS_ADDR,
// scoped by the API tokens as the accounter's console is: a tenant's
// token reads its tenant only, an admin's every tenant, no token nothing.
func TestAlertsAPI(t *testing.T) {
	e := newEnv(t, opsHook)
	e.cfg.Tokens.APITokens = []string{"tok-admin#admin", "tok-acme@acme"}
	e.start(nil)
	now := time.Now().UTC().Truncate(time.Second).Add(-time.Minute)
	e.publish(reserved("acme", "u1", "r1", 1, 0, now, userLimit(850, 0)),
		reserved("globex", "g1", "r2", 1, 0, now, userLimit(950, 0)))
	e2e.Eventually(t, "three threshold alerts delivered", func() bool { return len(e.recv.of(detect.KindThreshold)) == 3 })

	get := func(tok, tenant string) (int, []string) {
		t.Helper()
		req, _ := http.NewRequest("GET", "http://"+e.alerts+"/v1/alerts?tenant="+tenant, nil)
		if tok != "" {
			req.Header.Set("Authorization", "Bearer "+tok)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var l alertlog.List
		if err := json.NewDecoder(resp.Body).Decode(&l); err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, a := range l.Alerts {
			got = append(got, fmt.Sprintf("%s %s %d", a.User, a.Limit, a.Threshold))
		}
		return resp.StatusCode, got
	}
	for _, tc := range []struct {
		tok, tenant string
		code        int
		want        []string
	}{
		{"tok-acme", "acme", 200, []string{"u1 5h 80"}},
		{"tok-acme", "globex", 403, nil},
		{"", "acme", 401, nil},
		{"tok-admin", "globex", 200, []string{"g1 5h 90", "g1 5h 80"}},
	} {
		if code, got := get(tc.tok, tc.tenant); code != tc.code || !slices.Equal(got, tc.want) {
			t.Errorf("GET /v1/alerts?tenant=%s as %q = %d %q, want %d %q", tc.tenant, tc.tok, code, got, tc.code, tc.want)
		}
	}
}
