package alertlog_test

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"quotaflow/internal/alertlog"
	"quotaflow/internal/alertlog/alertlogtest"
	"quotaflow/internal/auth"
	"quotaflow/internal/pgdb"
	"quotaflow/internal/pgtest"
)

var t0 = time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)

// outbox returns a database of the test's own holding the alerter's
// outbox with acme's alerts a1 (then a2, to two webhooks) and globex's g1.
func outbox(t *testing.T) *pgxpool.Pool {
	t.Helper()
	pool := outboxOnly(t)
	alertlogtest.Threshold(t, pool, "a1", "acme", "u1", 80, t0, "ops")
	alertlogtest.Threshold(t, pool, "a2", "acme", "u2", 90, t0.Add(time.Minute), "ops", "pager")
	alertlogtest.Threshold(t, pool, "g1", "globex", "u1", 100, t0.Add(2*time.Minute), "ops")
	return pool
}

// outboxOnly returns a database of the test's own holding the alerter's
// empty outbox.
func outboxOnly(t *testing.T) *pgxpool.Pool {
	t.Helper()
	pool, err := pgdb.Open(context.Background(), pgtest.NewDatabase(t, "alertlog"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	alertlogtest.Migrate(t, pool)
	return pool
}

// alerter serves NewHandler over pool with an admin token, acme's token
// and a platform gateway's (every tenant, not admin).
func alerter(t *testing.T, pool *pgxpool.Pool) *httptest.Server {
	t.Helper()
	tokens, err := auth.New(auth.Options{Tokens: []string{"tok-admin#admin", "tok-acme@acme", "tok-gw"}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(alertlog.NewHandler(pool, tokens, nil))
	t.Cleanup(srv.Close)
	return srv
}

func ids(as []alertlog.Alert) []string {
	var out []string
	for _, a := range as {
		out = append(out, a.ID)
	}
	return out
}

// TestHandler: the alerter's GET /v1/alerts reads as the console does: a
// tenant's token its tenant only, an admin every tenant, a gateway's none;
// each alert once, newest first; bad parameters 400.
func TestHandler(t *testing.T) {
	srv := alerter(t, outbox(t))
	c, err := alertlog.NewClient(srv.URL, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		token, query string
		status       int
		want         []string
	}{
		{"", "tenant=acme", 401, nil},
		{"tok-unknown", "tenant=acme", 401, nil},
		{"tok-acme", "tenant=acme", 200, []string{"a2", "a1"}},
		{"tok-acme", "tenant=acme&limit=1&offset=1", 200, []string{"a1"}},
		{"tok-acme", "tenant=globex", 403, nil},
		{"tok-gw", "tenant=acme", 403, nil},
		{"tok-admin", "tenant=globex", 200, []string{"g1"}},
		{"tok-admin", "tenant=nobody", 200, nil},
		{"tok-admin", "", 400, nil},
		{"tok-admin", "tenant=" + url.QueryEscape("a\x01b"), 400, nil},
		{"tok-admin", "tenant=acme&limit=0", 400, nil},
		{"tok-admin", "tenant=acme&limit=501", 400, nil},
		{"tok-admin", "tenant=acme&offset=-1", 400, nil},
	} {
		req, _ := http.NewRequest("GET", srv.URL+"/v1/alerts?"+tc.query, nil)
		if tc.token != "" {
			req.Header.Set("Authorization", "Bearer "+tc.token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != tc.status {
			t.Errorf("GET ?%s as %q = %d, want %d", tc.query, tc.token, resp.StatusCode, tc.status)
		}
		if tc.status != 200 {
			continue
		}
		q, _ := url.ParseQuery(tc.query)
		limit, offset := alertlog.DefaultLimit, 0
		if q.Get("limit") != "" {
			limit, offset = 1, 1
		}
		as, err := c.Recent(context.Background(), "Bearer "+tc.token, q.Get("tenant"), limit, offset)
		if err != nil || !slices.Equal(ids(as), tc.want) {
			t.Errorf("Recent(%s as %q) = %v, %v; want %v", tc.query, tc.token, ids(as), err, tc.want)
		}
	}
}

// TestClientErrors: the accounter's client says whether the alerter could
// not be reached (503 to its caller) or answered no alerts (502), with
// the alerter's reason and never the token; it follows no redirect and
// reads no more than its bound.
func TestClientErrors(t *testing.T) {
	srv := alerter(t, outbox(t))
	var redirected atomic.Int32
	target := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { redirected.Add(1) }))
	t.Cleanup(target.Close)
	odd := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Query().Get("tenant") {
		case "redirect":
			http.Redirect(w, r, target.URL, http.StatusFound)
		case "huge":
			w.Write([]byte(`{"alerts":[`))
			w.Write([]byte(strings.Repeat(`{"id":"x"},`, 200000)))
			w.Write([]byte(`{"id":"x"}]}`))
		case "slow":
			<-r.Context().Done()
		default:
			w.Write([]byte(`{"users":[]}`))
		}
	}))
	t.Cleanup(odd.Close)
	closed := httptest.NewServer(http.NotFoundHandler())
	closed.Close()

	client := func(u string) *alertlog.Client {
		c, err := alertlog.NewClient(u, 2*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	for _, tc := range []struct {
		name, url, tenant string
		want              error
		says              string
	}{
		{"refused", srv.URL, "globex", alertlog.ErrBadAnswer, "403 Forbidden: this token may not read that tenant"},
		{"down", closed.URL, "acme", alertlog.ErrUnreachable, "connect"},
		{"slow", odd.URL, "slow", alertlog.ErrUnreachable, "Timeout"},
		{"redirect", odd.URL, "redirect", alertlog.ErrBadAnswer, "302"},
		{"huge", odd.URL, "huge", alertlog.ErrBadAnswer, "over 1048576 bytes"},
		{"not alerts", odd.URL, "other", alertlog.ErrBadAnswer, "not a JSON list of alerts"},
	} {
		_, err := client(tc.url).Recent(context.Background(), "Bearer tok-acme", tc.tenant, 10, 0)
		if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("%s: Recent = %v, want %v saying %q", tc.name, err, tc.want, tc.says)
		}
		if err != nil && strings.Contains(err.Error(), "tok-acme") {
			t.Errorf("%s: the error %q holds the token", tc.name, err)
		}
	}
	if n := redirected.Load(); n != 0 {
		t.Errorf("the redirect was followed %d times, want never (the token would go with it)", n)
	}
}

func TestCheckURL(t *testing.T) {
	for _, tc := range []struct {
		url string
		ok  bool
	}{
		{"http://alerter:8082", true},
		{"https://alerter.internal/", true},
		{"ftp://alerter", false},
		{"alerter:8082", false},
		{"http://", false},
		{"http://user:pw@alerter", false},
		{"http://alerter/?x=1", false},
		{"http://alerter/#f", false},
	} {
		if err := alertlog.CheckURL(tc.url); (err == nil) != tc.ok {
			t.Errorf("CheckURL(%q) = %v, want ok %v", tc.url, err, tc.ok)
		}
	}
}

// TestHandlerFailures: a failed query is a 500 whether or not the alerter
// was given a logger, logged at Error without the token; a query its
// caller hung up on is not an Error.
func TestHandlerFailures(t *testing.T) {
	empty, err := pgdb.Open(context.Background(), pgtest.NewDatabase(t, "alertlog_empty"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(empty.Close)
	tokens, err := auth.New(auth.Options{Tokens: []string{"tok-admin#admin"}})
	if err != nil {
		t.Fatal(err)
	}
	get := func(h http.Handler, ctx context.Context) int {
		req := httptest.NewRequestWithContext(ctx, "GET", "/v1/alerts?tenant=acme", nil)
		req.Header.Set("Authorization", "Bearer tok-admin")
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		return w.Code
	}
	if code := get(alertlog.NewHandler(empty, tokens, nil), context.Background()); code != 500 {
		t.Errorf("GET on a database without the outbox, no logger = %d, want 500", code)
	}

	var logs strings.Builder
	log := slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	get(alertlog.NewHandler(empty, tokens, log), context.Background())
	if n := strings.Count(logs.String(), `"level":"ERROR"`); n != 1 || strings.Contains(logs.String(), "tok-admin") {
		t.Errorf("a failed query logged %d errors, want 1 without the token: %s", n, logs.String())
	}
	logs.Reset()
	gone, cancel := context.WithCancel(context.Background())
	cancel()
	get(alertlog.NewHandler(outbox(t), tokens, log), gone)
	if strings.Contains(logs.String(), `"level":"ERROR"`) || !strings.Contains(logs.String(), "given up by its caller") {
		t.Errorf("a query whose caller hung up logged %s, want one Debug record", logs.String())
	}
}

// TestClientIgnoresProxy: HTTP_PROXY does not receive the caller's token.
// The proxy setting is read once a process, so a child process of the
// test binary makes the call.
func TestClientIgnoresProxy(t *testing.T) {
	if os.Getenv("QF_ALERTLOG_PROXY_CHILD") != "" {
		c, err := alertlog.NewClient("http://alerter.invalid:8082", 2*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		c.Recent(context.Background(), "Bearer tok-admin", "acme", 10, 0)
		return
	}
	var proxied atomic.Int32
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		proxied.Add(1)
		w.Write([]byte(`{"alerts":[]}`))
	}))
	t.Cleanup(proxy.Close)
	cmd := exec.Command(os.Args[0], "-test.run=^TestClientIgnoresProxy$")
	cmd.Env = append(os.Environ(), "QF_ALERTLOG_PROXY_CHILD=1", "HTTP_PROXY="+proxy.URL, "HTTPS_PROXY="+proxy.URL, "NO_PROXY=")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("child: %v: %s", err, out)
	}
	if n := proxied.Load(); n != 0 {
		t.Errorf("the proxy received %d requests with the token, want none", n)
	}
}
