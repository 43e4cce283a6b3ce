package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"quotaflow/internal/alertlog/alertlogtest"
	"quotaflow/internal/e2e"
)

// TestConsole signs in on the accounter's real console listener and reads
// its pages: the top users' numbers are the ledger's, the users' windows
// Redis's, the near page holds the one window over its threshold, and a
// tenant's token neither sees nor reaches another tenant's pages.
func TestConsole(t *testing.T) {
	e := newEnv(t)
	e.initialised(t)
	e.cfg.Tokens.APITokens = []string{"console-admin#admin", "console-acme@acme"}
	var consoleAddr string
	e.start(&hooks{console: func(addr string) { consoleAddr = addr }})
	for i, sub := range []struct{ tenant, user string }{{"acme", "alice"}, {"acme", "alice"}, {"acme", "bob"}, {"globex", "gina"}} {
		req := fmt.Sprintf("req-%d", i)
		e.reserve(sub.tenant, sub.user, req, 50, true)
		e.publish(e.actual(sub.tenant, sub.user, req, "big-model", 10, int64(10*(i+1))))
	}
	e.consumedAll("acme", 3)
	e.consumedAll("globex", 1)

	base := "http://" + consoleAddr
	acme := signIn(t, base, "console-acme")
	admin := signIn(t, base, "console-admin")

	code, body := get(t, acme, base+"/tenants/acme/top")
	if code != 200 {
		t.Fatalf("acme's top = %d", code)
	}
	for _, u := range []string{"alice", "bob"} {
		want := e.count("SELECT sum(tokens) FROM usage_rollups WHERE tenant='acme' AND user_id=$1", u)
		row := regexp.MustCompile(`data-user="` + u + `".*?class="num tokens">(\d+)<`).FindStringSubmatch(body)
		if row == nil || row[1] != fmt.Sprint(want) {
			t.Errorf("top's tokens of %s = %v, want %d (the ledger's)", u, row, want)
		}
	}
	if strings.Contains(body, "gina") {
		t.Error("acme's top shows globex's user")
	}
	// The users page shows each user's windows as Redis holds them.
	e.reserve("acme", "bob", "big", 95000, false) // bob's 5h at 95 %: near 90
	code, body = get(t, acme, base+"/tenants/acme")
	if code != 200 {
		t.Fatalf("acme's users = %d", code)
	}
	for _, u := range []string{"alice", "bob"} {
		for _, l := range []string{"5h", "30d"} {
			used := e.used("acme", u, l)
			row := regexp.MustCompile(`(?s)data-user="` + u + `" data-limit="user ` + l + `">.*?class="num used">(\d+)<.*?class="num remaining">(\d+)<`).FindStringSubmatch(body)
			if row == nil || row[1] != fmt.Sprint(used) || row[2] != fmt.Sprint(limitOf(t, e, l)-used) {
				t.Errorf("users page: %s's %s = %v, want used %d (Redis's), remaining %d", u, l, row, used, limitOf(t, e, l)-used)
			}
		}
	}
	if strings.Contains(body, "gina") {
		t.Error("acme's users show globex's user")
	}
	code, body = get(t, acme, base+"/tenants/acme/near?threshold=90")
	if code != 200 || !strings.Contains(body, `data-user="bob" data-limit="user 5h"`) || strings.Contains(body, `data-user="alice"`) || strings.Contains(body, `data-limit="user 30d"`) {
		t.Errorf("acme's users near 90 %% = %d, want bob's 5h alone:\n%s", code, body)
	}
	for _, path := range []string{"/tenants/globex", "/tenants/globex/near", "/tenants/globex/top", "/tenants/globex/usage", "/tenants/globex/denials", "/tenants/globex/alerts"} {
		if code, body := get(t, acme, base+path); code != 404 || strings.Contains(body, "gina") {
			t.Errorf("acme's token GET %s = %d, want 404 without globex's data", path, code)
		}
	}
	if code, body := get(t, acme, base+"/"); code != 200 || strings.Contains(body, "globex") {
		t.Errorf("acme's home = %d, want its own tenant only:\n%s", code, body)
	}
	code, body = get(t, admin, base+"/")
	if code != 200 || !strings.Contains(body, "acme") || !strings.Contains(body, "globex") {
		t.Errorf("admin's home = %d, want both tenants:\n%s", code, body)
	}
	if code, body := get(t, admin, base+"/tenants/globex/top"); code != 200 || !strings.Contains(body, "gina") {
		t.Errorf("admin's globex top = %d, want gina:\n%s", code, body)
	}

	// Past a page of tenants, the home links the next page.
	if _, err := e.pgPool(t).Exec(context.Background(), `INSERT INTO reservations (tenant, user_id, request_id)
SELECT 'many-' || lpad(i::text, 3, '0'), 'u', 'r' FROM generate_series(1, $1::int) i`, tenantsPerPage); err != nil {
		t.Fatal(err)
	}
	// acme, globex, then many-001 to many-500: the first page ends at many-498.
	link := regexp.MustCompile(`<a href="/tenants/([^"]*)">`)
	for _, pg := range []struct {
		path, first, last, next string
	}{
		{"/", "acme", "many-498", "/?after=many-498"},
		{"/?after=many-498", "many-499", "many-500", ""},
	} {
		code, body := get(t, admin, base+pg.path)
		ts := link.FindAllStringSubmatch(body, -1)
		next := regexp.MustCompile(`id="next" href="([^"]*)"`).FindStringSubmatch(body)
		switch {
		case code != 200 || len(ts) == 0:
			t.Errorf("admin's GET %s = %d with %d tenants", pg.path, code, len(ts))
		case ts[0][1] != pg.first || ts[len(ts)-1][1] != pg.last || pg.next == "" && next != nil || pg.next != "" && (next == nil || next[1] != pg.next):
			t.Errorf("admin's GET %s lists %d tenants, %s to %s, next %v; want %s to %s, next %q", pg.path, len(ts), ts[0][1], ts[len(ts)-1][1], next, pg.first, pg.last, pg.next)
		}
	}
}

// limitOf is the limit of the policy's free plan named name.
func limitOf(t *testing.T, e *env, name string) int64 {
	t.Helper()
	for _, r := range e.rules("acme") {
		if r.Name == name {
			return r.Limit.Limit
		}
	}
	t.Fatalf("no limit %s", name)
	return 0
}

// signIn posts tok to the console's sign-in form and returns a client
// holding its cookie.
func signIn(t *testing.T, base, tok string) *http.Client {
	t.Helper()
	jar, err := cookiejar.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	c := &http.Client{Jar: jar}
	resp, err := c.PostForm(base+"/signin", url.Values{"token": {tok}})
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	u, _ := url.Parse(base)
	if resp.StatusCode != 200 || len(jar.Cookies(u)) != 1 {
		t.Fatalf("sign in with %s = %d, cookies %v", tok, resp.StatusCode, jar.Cookies(u))
	}
	return c
}

func get(t *testing.T, c *http.Client, u string) (int, string) {
	t.Helper()
	resp, err := c.Get(u)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

// lockOutbox gives the accounter's database the alerter's outbox (the
// console's alerts then read it) and holds an exclusive lock on it until
// unlock is called (at the latest when the test ends): every read of
// alerts waits, as a long read would run, while the consumer, which never
// touches the outbox, could go on.
func lockOutbox(t *testing.T, e *env) (unlock func()) {
	t.Helper()
	ctx := context.Background()
	pg := e.pgPool(t)
	alertlogtest.Migrate(t, pg)
	tx, err := pg.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	unlock = func() { tx.Rollback(ctx) }
	t.Cleanup(unlock)
	if _, err := tx.Exec(ctx, `LOCK TABLE webhook_outbox IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	return unlock
}

// blockedReads counts the accounter's sessions waiting for a lock.
func blockedReads(t *testing.T, e *env) int {
	t.Helper()
	return int(e.count(`SELECT count(*) FROM pg_stat_activity
		WHERE datname = current_database() AND wait_event_type = 'Lock' AND application_name <> $1`, testAppName))
}

// bearerGet GETs u with tok as its bearer token, failing the test (rather
// than hanging) when no answer comes.
func bearerGet(t *testing.T, tok, u string) (int, string) {
	t.Helper()
	req, err := http.NewRequest("GET", u, nil)
	if err != nil {
		t.Error(err)
		return 0, ""
	}
	req.Header.Set("Authorization", "Bearer "+tok)
	resp, err := (&http.Client{Timeout: time.Minute}).Do(req)
	if err != nil {
		t.Errorf("GET %s: %v", u, err)
		return 0, ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestConsoleReadsCannotStarveTheLedger: a token bound to one tenant that
// keeps 16 of the console's reads in flight, each stuck in Postgres, holds
// no more than QF_CONSOLE_DB_CONNS connections; the others wait for those,
// and the consumer goes on writing every tenant's events to the ledger.
func TestConsoleReadsCannotStarveTheLedger(t *testing.T) {
	e := newEnv(t)
	e.initialised(t)
	e.cfg.Tokens.APITokens = []string{"big-tok@big"}
	e.cfg.ConsoleDBConns, e.cfg.ConsoleQueryTimeout = 2, 5*time.Minute // the reads stay stuck
	var consoleAddr string
	e.start(&hooks{console: func(addr string) { consoleAddr = addr }})
	unlock := lockOutbox(t, e)

	var wg sync.WaitGroup
	codes := make(chan int, 16)
	for range 16 {
		wg.Go(func() {
			code, _ := bearerGet(t, "big-tok", "http://"+consoleAddr+"/v1/alerts?tenant=big")
			codes <- code
		})
	}
	e2e.Eventually(t, "the console's reads stuck", func() bool { return blockedReads(t, e) >= e.cfg.ConsoleDBConns })

	e.reserve("acme", "alice", "r1", 50, true)
	e.publish(e.actual("acme", "alice", "r1", "", 10, 0))
	e.consumedAll("acme", 1)
	if n := blockedReads(t, e); n != e.cfg.ConsoleDBConns {
		t.Errorf("%d of the accounter's sessions wait behind the console's reads, want QF_CONSOLE_DB_CONNS (%d)", n, e.cfg.ConsoleDBConns)
	}

	unlock()
	wg.Wait()
	close(codes)
	for code := range codes {
		if code != 200 {
			t.Errorf("a read once the lock went = %d, want 200", code)
		}
	}
}

// TestConsoleReadPastItsTimeoutIsAnswered: a read of the ledger that does
// not finish within QF_CONSOLE_QUERY_TIMEOUT, the one stuck in Postgres and
// the one waiting for its connection alike, is answered 503 with a short
// reason, by the usage API and by the console's page, never a hang or the
// driver's text.
func TestConsoleReadPastItsTimeoutIsAnswered(t *testing.T) {
	e := newEnv(t)
	e.initialised(t)
	e.cfg.Tokens.APITokens = []string{"big-tok@big"}
	e.cfg.ConsoleDBConns, e.cfg.ConsoleQueryTimeout = 1, 300*time.Millisecond
	var consoleAddr string
	e.start(&hooks{console: func(addr string) { consoleAddr = addr }})
	lockOutbox(t, e)
	base := "http://" + consoleAddr

	var wg sync.WaitGroup
	for range 3 { // one stuck, two waiting for its connection
		wg.Go(func() {
			code, body := bearerGet(t, "big-tok", base+"/v1/alerts?tenant=big")
			if code != 503 || !strings.Contains(body, "QF_CONSOLE_QUERY_TIMEOUT") || strings.Contains(body, "SQLSTATE") || strings.Contains(body, "context") {
				t.Errorf("GET /v1/alerts past the timeout = %d %s, want 503 saying the read took too long", code, body)
			}
		})
	}
	wg.Wait()
	browser := signIn(t, base, "big-tok")
	browser.Timeout = time.Minute // only so that a hang fails
	code, body := get(t, browser, base+"/tenants/big/alerts")
	if code != 503 || !strings.Contains(body, "Reading the ledger took too long") {
		t.Errorf("the alerts page past the timeout = %d, want 503 saying the read took too long:\n%s", code, body)
	}
}
