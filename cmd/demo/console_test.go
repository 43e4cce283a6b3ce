package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5"

	"quotaflow/internal/browser"
	"quotaflow/internal/e2e"
)

// updateShots, set to 1, also writes the screenshots into docs/console,
// where the README shows them; otherwise they go to the test's artifact
// directory only (kept by `go test -artifacts`), and CI writes nothing
// into the tree.
const updateShots = "QF_UPDATE_SCREENSHOTS"

// Screen sizes of the screenshots: a desktop's and a phone's.
const (
	desktopW, desktopH = 1280, 900
	narrowW, narrowH   = 360, 740
)

// stepTimeout bounds each browser step, so that a missing element fails
// the test in seconds, naming it, rather than at the browser's deadline.
const stepTimeout = 20 * time.Second

// console drives the demo's console in chromium while its services run.
type console struct {
	t     *testing.T
	ctx   context.Context // the browser's: each step runs in step()
	b     *browser.Browser
	base  string
	db    *pgx.Conn // the run's ledger, read with this file's own SQL
	rep   *Report
	shots []string // directories the screenshots go to
}

// checkConsole signs in to the run's console with the admin token and
// checks every page of two tenants against the ledger, read here with SQL
// of its own (the rollups, the events, the alerter's outbox) rather than
// the console's queries, the users' windows in Redis included; then it signs in with the token bound to the
// first tenant, which reaches no page and no API call of another tenant.
// It saves a screenshot of each page (docs/console with QF_UPDATE_SCREENSHOTS=1).
func checkConsole(t *testing.T, cfg Config, rep *Report) {
	b := browser.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pgURL, err := databaseURL(cfg.PostgresURL, rep.Database)
	if err != nil {
		t.Fatal(err)
	}
	db, err := pgx.Connect(ctx, pgURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close(context.Background()) })
	c := &console{t: t, ctx: b.Ctx, b: b, base: strings.TrimSuffix(rep.Console, "/"), db: db, rep: rep, shots: []string{t.ArtifactDir()}}
	if os.Getenv(updateShots) == "1" {
		root, err := e2e.ModuleRoot(ctx)
		if err != nil {
			t.Fatal(err)
		}
		c.shots = append(c.shots, filepath.Join(root, "docs", "console"))
	}
	c.do(chromedp.EmulateViewport(desktopW, desktopH))

	c.signIn(rep.ConsoleAdmin, "#tenants")
	shown := c.texts("#tenants a")
	if want := c.column(`SELECT DISTINCT tenant FROM usage_rollups ORDER BY tenant`); !slices.Equal(shown, want) {
		t.Errorf("the tenants page lists %q, want the ledger's tenants %q", shown, want)
	}
	c.shot("tenants")

	tenants := rep.Tenants[:2] // both have a hammering script, so denials
	for i, tn := range tenants {
		c.checkNear(tn, namesFor(rep.Run).quota5h, c.checkUsers(tn))
		c.checkUsage(tn, "")
		c.checkUsage(tn, "heavy")
		c.checkTop(tn)
		c.checkDenials(tn)
		c.checkAlerts(tn)
		if i == 0 {
			for _, p := range pages {
				c.open(pagePath(tn, p), "main h1")
				c.shot(p)
			}
		}
	}
	// A phone's width: the users' table scrolls inside its region.
	c.do(chromedp.EmulateViewport(narrowW, narrowH))
	c.open(pagePath(tenants[0], "users"), "#users")
	c.shot("users-narrow")
	c.do(chromedp.EmulateViewport(desktopW, desktopH))

	if errs := b.Errors(); len(errs) > 0 {
		t.Errorf("the pages logged errors: %q", errs)
	}
	if f := b.Foreign(); len(f) > 0 {
		t.Errorf("requests left the loopback: %q", f)
	}

	c.checkTenantToken(rep.ConsoleTenant, tenants[0], rep.Tenants[1:])
}

// pages are a tenant's pages.
var pages = []string{"users", "near", "usage", "top", "denials", "alerts"}

// pagePath is the path of a tenant's page (one of pages).
func pagePath(tenant, p string) string {
	if p == "users" {
		return "/tenants/" + tenant
	}
	return "/tenants/" + tenant + "/" + p
}

// step returns the browser's context for one step, bounded by
// stepTimeout.
func (c *console) step() context.Context {
	ctx, cancel := context.WithTimeout(c.ctx, stepTimeout)
	c.t.Cleanup(cancel)
	return ctx
}

func (c *console) do(as ...chromedp.Action[chromedp.Void]) {
	c.t.Helper()
	if err := chromedp.Do(c.step(), as...); err != nil {
		c.t.Fatal(err)
	}
}

// open loads path and waits until sel is visible.
func (c *console) open(path, sel string) {
	c.t.Helper()
	if err := chromedp.Do(c.step(), chromedp.Navigate(c.base+path), chromedp.WaitVisible(sel)); err != nil {
		c.t.Fatalf("%s: waiting for %s: %v", path, sel, err)
	}
}

// signIn enters tok in the sign-in form and waits for sel on the page the
// console then shows.
func (c *console) signIn(tok, sel string) {
	c.t.Helper()
	c.open("/signin", "#token")
	if err := chromedp.Do(c.step(), chromedp.SendKeys("#token", tok), chromedp.Submit("#token"), chromedp.WaitVisible(sel)); err != nil {
		c.t.Fatalf("sign in: waiting for %s: %v", sel, err)
	}
}

// eval evaluates a JavaScript expression in the page.
func eval[T any](c *console, js string, opts ...chromedp.EvaluateOption) T {
	c.t.Helper()
	v, err := chromedp.Run(c.step(), chromedp.Evaluate[T](js, opts...))
	if err != nil {
		c.t.Fatalf("%s: %v", js, err)
	}
	return v
}

// texts returns the text of every element sel matches.
func (c *console) texts(sel string) []string {
	c.t.Helper()
	return eval[[]string](c, fmt.Sprintf(`Array.from(document.querySelectorAll(%q), e => e.textContent.trim())`, sel))
}

// cells returns the text of the cells of every row sel matches.
func (c *console) cells(sel string) [][]string {
	c.t.Helper()
	return eval[[][]string](c, fmt.Sprintf(`Array.from(document.querySelectorAll(%q), tr => Array.from(tr.querySelectorAll("th, td"), e => e.textContent.trim()))`, sel))
}

// num parses a number a page shows.
func (c *console) num(s string) int64 {
	c.t.Helper()
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		c.t.Fatalf("a page shows %q where a number belongs", s)
	}
	return n
}

// column reads the first column of a query's rows as text.
func (c *console) column(sql string, args ...any) []string {
	c.t.Helper()
	rows, err := c.db.Query(context.Background(), sql, args...)
	if err != nil {
		c.t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		c.t.Fatal(err)
	}
	return out
}

// totals is tokens and requests.
type totals [2]int64

// usersInLedger returns each user's tokens and admitted requests in the
// tenant's rollups.
func (c *console) usersInLedger(tenant string) map[string]totals {
	c.t.Helper()
	rows, err := c.db.Query(context.Background(),
		`SELECT user_id, sum(tokens)::bigint, sum(requests)::bigint FROM usage_rollups WHERE tenant = $1 GROUP BY user_id`, tenant)
	if err != nil {
		c.t.Fatal(err)
	}
	out := map[string]totals{}
	var u string
	var tot totals
	if _, err := pgx.ForEachRow(rows, []any{&u, &tot[0], &tot[1]}, func() error {
		out[u] = tot
		return nil
	}); err != nil {
		c.t.Fatal(err)
	}
	return out
}

// window is one row of the users or near page: a user's limit.
type window struct {
	User, Limit         string
	Used, Of, Remaining int64
	Reset               time.Time // zero when the page shows none
}

// windows reads the users' rows of the users or near page shown.
func (c *console) windows() []window {
	c.t.Helper()
	var out []window
	for _, r := range eval[[][]string](c, `Array.from(document.querySelectorAll("#users tbody tr[data-user][data-limit]"), tr =>
		[tr.dataset.user, tr.dataset.limit].concat([".used", ".limit", ".remaining", ".reset"].map(s => tr.querySelector(s).textContent.trim())))`) {
		w := window{User: r[0], Limit: r[1], Used: c.num(r[2]), Of: c.num(r[3]), Remaining: c.num(r[4])}
		if r[5] != "—" {
			var err error
			if w.Reset, err = time.Parse("2006-01-02 15:04:05Z", r[5]); err != nil {
				c.t.Fatalf("%s's %s resets at %q: %v", w.User, w.Limit, r[5], err)
			}
		}
		out = append(out, w)
	}
	return out
}

// tokenWindows are the demo plan's token quotas by name, with their
// lengths: the run is shorter than both and its tenants are its own, so a
// user's used tokens in either are its tokens in the ledger. The traffic
// is over, so they hold still (the request rate's bucket refills).
var tokenWindows = map[string]time.Duration{"5h": 5 * time.Hour, "7d": 7 * 24 * time.Hour}

// checkUsers compares the users page with the ledger and Redis: its users
// are the ledger's; each user's 5h and 7d windows are what admission's GET
// /v1/usage reads of Redis (used, of, remaining, and the reset its
// reset_seconds count to), and their used is the user's tokens in the
// ledger; every window's remaining is what its limit leaves, and one in
// use frees capacity within its length. It returns the windows shown, by
// user and limit.
func (c *console) checkUsers(tenant string) map[string]window {
	c.t.Helper()
	path := pagePath(tenant, "users")
	c.open(path, "#users")
	shown := map[string]window{}
	var users []string
	now := time.Now()
	for _, w := range c.windows() {
		if !slices.Contains(users, w.User) {
			users = append(users, w.User)
		}
		shown[w.User+" "+w.Limit] = w
		if w.Remaining != max(0, w.Of-w.Used) {
			c.t.Errorf("%s: %s's %s: used %d of %d, remaining %d", path, w.User, w.Limit, w.Used, w.Of, w.Remaining)
		}
		d, ok := tokenWindows[strings.TrimPrefix(w.Limit, "user ")]
		if ok && w.Used > 0 && (!w.Reset.After(now.Add(-time.Minute)) || w.Reset.After(now.Add(d))) {
			c.t.Errorf("%s: %s's %s frees capacity at %v, want within %v", path, w.User, w.Limit, w.Reset, d)
		}
	}
	if want := c.column(`SELECT DISTINCT user_id FROM reservations WHERE tenant = $1 ORDER BY user_id LIMIT 50`, tenant); !slices.Equal(users, want) {
		c.t.Errorf("%s lists users %q, want the ledger's %q", path, users, want)
	}
	ledger := c.usersInLedger(tenant)
	compared := 0
	for _, u := range users {
		var got struct {
			Limits []struct {
				Scope, Name            string
				Limit, Used, Remaining int64
				ResetSeconds           int64 `json:"reset_seconds"`
			}
		}
		asked := time.Now().Truncate(time.Second)
		if code := c.admission("/v1/usage?"+url.Values{"tenant": {tenant}, "user": {u}}.Encode(), &got); code != 200 {
			c.t.Fatalf("admission's GET /v1/usage of %s/%s = %d", tenant, u, code)
		}
		for _, l := range got.Limits {
			if _, ok := tokenWindows[l.Name]; !ok {
				continue
			}
			compared++
			key := u + " " + l.Scope + " " + l.Name
			w := shown[key]
			if [3]int64{w.Used, w.Of, w.Remaining} != [3]int64{l.Used, l.Limit, l.Remaining} {
				c.t.Errorf("%s: %s shows used, of, remaining %d, %d, %d; admission reads %d, %d, %d in Redis", path, key, w.Used, w.Of, w.Remaining, l.Used, l.Limit, l.Remaining)
			}
			if w.Used != ledger[u][0] {
				c.t.Errorf("%s: %s used %d, the user's tokens in the ledger %d", path, key, w.Used, ledger[u][0])
			}
			// Admission counts reset_seconds (rounded up) from its call: the
			// page's reset, in whole seconds, is that many seconds after it.
			lo, hi := asked.Add(time.Duration(l.ResetSeconds-1)*time.Second), time.Now().Add(time.Duration(l.ResetSeconds)*time.Second)
			if l.ResetSeconds == 0 && !w.Reset.IsZero() || l.ResetSeconds > 0 && (w.Reset.Before(lo) || w.Reset.After(hi)) {
				c.t.Errorf("%s: %s resets at %v; admission's reset_seconds %d from %v", path, key, w.Reset, l.ResetSeconds, asked)
			}
		}
	}
	if compared != len(tokenWindows)*len(users) || len(users) == 0 {
		c.t.Errorf("%s: compared %d windows of %d users, want the 5h and 7d of each", path, compared, len(users))
	}
	return shown
}

// admission GETs path of admission's API with the run's token, decodes a
// 200's JSON into v, and returns the status.
func (c *console) admission(path string, v any) int {
	c.t.Helper()
	req, err := http.NewRequest("GET", c.rep.API+path, nil)
	if err != nil {
		c.t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+c.rep.APIToken)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		c.t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode == 200 {
		if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
			c.t.Fatal(err)
		}
	}
	return resp.StatusCode
}

// checkNear compares the near page (at 80 %, its default) with the
// ledger: the users whose tokens reach 80 % of the 5 h quota (the 7 d one
// is 20 times larger; the request rate's bucket has refilled), each with
// that window alone, and each user whose /v1/chat limit of 100 requests a
// day is at 80 % on the users page, as that page showed them (users).
func (c *console) checkNear(tenant string, quota int64, users map[string]window) {
	c.t.Helper()
	path := pagePath(tenant, "near")
	c.open(path, "#threshold")
	var shown, want []string
	for _, w := range c.windows() {
		shown = append(shown, w.User+" "+w.Limit)
		if u := users[w.User+" "+w.Limit]; w != u {
			c.t.Errorf("%s shows %+v, the users page %+v", path, w, u)
		}
	}
	for u, tot := range c.usersInLedger(tenant) {
		if tot[0]*100 >= 80*quota {
			want = append(want, u+" user 5h")
		}
	}
	// The per-user limit of /v1/chat (100 requests a day), which admission
	// enforces on requests to it, is near as the users page shows it.
	for key, w := range users {
		if strings.HasPrefix(w.Limit, "endpoint ") && w.Used*100 >= 80*w.Of {
			want = append(want, key)
		}
	}
	slices.Sort(shown)
	slices.Sort(want)
	if len(want) == 0 {
		c.t.Errorf("%s: no user of the ledger at 80 %% of the 5 h quota: the heavy user should be", path)
	}
	if !slices.Equal(shown, want) {
		c.t.Errorf("%s shows %q, want %q (from the ledger)", path, shown, want)
	}
}

// checkUsage compares the usage page's table (24 hours) and its chart's
// points with the ledger's rollups of the tenant, or of one user, hour by
// hour.
func (c *console) checkUsage(tenant, user string) {
	c.t.Helper()
	path := pagePath(tenant, "usage")
	if user != "" {
		path += "?user=" + user
	}
	c.open(path, "#chart canvas")
	rows := c.cells("#usage tbody tr")
	if len(rows) != 24 {
		c.t.Fatalf("%s: %d rows, want one per hour of the last 24 hours: %q", path, len(rows), rows)
	}
	hours := c.hoursInLedger(tenant, user)
	if len(hours) == 0 {
		c.t.Fatalf("%s: the ledger holds no usage: nothing to compare", path)
	}
	var table [][3]int64
	for _, r := range rows {
		tok, req := c.num(r[1]), c.num(r[2])
		if want := hours[r[0]]; (totals{tok, req}) != want {
			c.t.Errorf("%s: the hour of %s shows %d tokens, %d requests; the ledger's rollups %d, %d", path, r[0], tok, req, want[0], want[1])
		}
		delete(hours, r[0])
		table = append(table, [3]int64{0, tok, req})
	}
	if len(hours) > 0 {
		c.t.Errorf("%s: the ledger's hours %v are not on the page", path, hours)
	}
	chart := eval[[][]int64](c, `JSON.parse(document.getElementById("chart").dataset.points)`)
	if len(chart) != 3 || len(chart[0]) != len(table) {
		c.t.Fatalf("%s: the chart's points %v, want the table's %d rows", path, chart, len(table))
	}
	for i, r := range table {
		if chart[1][i] != r[1] || chart[2][i] != r[2] {
			c.t.Errorf("%s: the chart's point %d is %d tokens, %d requests; the table's %d, %d", path, i, chart[1][i], chart[2][i], r[1], r[2])
		}
	}
}

// hoursInLedger returns the tenant's (or user's, unless "") tokens and
// requests in the rollups by hour, keyed by the hour's start as the pages
// show it. The run is shorter than the usage page's 24 hours.
func (c *console) hoursInLedger(tenant, user string) map[string]totals {
	c.t.Helper()
	rows, err := c.db.Query(context.Background(), `
SELECT to_char(bucket_start AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS"Z"'), sum(tokens)::bigint, sum(requests)::bigint
FROM usage_rollups WHERE tenant = $1 AND ($2 = '' OR user_id = $2) GROUP BY bucket_start`, tenant, user)
	if err != nil {
		c.t.Fatal(err)
	}
	out := map[string]totals{}
	var h string
	var tot totals
	if _, err := pgx.ForEachRow(rows, []any{&h, &tot[0], &tot[1]}, func() error {
		out[h] = tot
		return nil
	}); err != nil {
		c.t.Fatal(err)
	}
	return out
}

// checkTop compares the top users page with each user's rollups.
func (c *console) checkTop(tenant string) {
	c.t.Helper()
	path := pagePath(tenant, "top")
	c.open(path, "#top")
	shown := map[string]totals{}
	var order []int64
	for _, r := range c.cells("#top tbody tr[data-user]") {
		shown[r[1]] = totals{c.num(r[2]), c.num(r[3])}
		order = append(order, c.num(r[2]))
	}
	if want := c.usersInLedger(tenant); fmt.Sprint(shown) != fmt.Sprint(want) {
		c.t.Errorf("%s shows %v, the ledger's rollups %v (user: tokens, requests)", path, shown, want)
	}
	if !slices.IsSortedFunc(order, func(a, b int64) int { return int(b - a) }) {
		c.t.Errorf("%s: tokens %v, want the most first", path, order)
	}
}

// checkDenials compares the denials page with the denied events in the
// ledger, by the limit (scope and name) that denied them.
func (c *console) checkDenials(tenant string) {
	c.t.Helper()
	path := pagePath(tenant, "denials")
	c.open(path, "#denials")
	shown := map[string]int64{}
	for _, r := range c.cells("#denials tbody tr[data-limit]") {
		shown[r[0]] = c.num(r[1])
	}
	rows, err := c.db.Query(context.Background(), `
SELECT e->'data'->>'scope', e->'data'->>'name', (e->'data'->>'count')::bigint
FROM (SELECT convert_from(event, 'UTF8')::jsonb AS e FROM usage_events
    WHERE tenant = $1 AND type = 'quotaflow.usage.denied') d`, tenant)
	if err != nil {
		c.t.Fatal(err)
	}
	want := map[string]int64{}
	var scope, name string
	var n int64
	if _, err := pgx.ForEachRow(rows, []any{&scope, &name, &n}, func() error {
		want[scope+" "+name] += n
		return nil
	}); err != nil {
		c.t.Fatal(err)
	}
	if len(want) == 0 {
		c.t.Errorf("%s: no denied event in the ledger: the hammering script should be denied", path)
	}
	if fmt.Sprint(shown) != fmt.Sprint(want) {
		c.t.Errorf("%s shows %v, the ledger's denied events %v", path, shown, want)
	}
}

// checkAlerts compares the recent alerts page with the alerter's outbox
// (each alert once, whatever the webhooks it went to). The alerter may
// still raise one (a spike's end), so the outbox is read before and after
// the page, which must show one of the two.
func (c *console) checkAlerts(tenant string) {
	c.t.Helper()
	path := pagePath(tenant, "alerts")
	before := c.outbox(tenant)
	c.open(path, "#alerts")
	var shown []string
	for _, r := range c.cells("#alerts tbody tr") {
		if len(r) == 5 { // not the "No alerts yet." row
			shown = append(shown, strings.Join(r, " | "))
		}
	}
	slices.Sort(shown)
	after := c.outbox(tenant)
	if len(after) > alertsShown {
		c.t.Fatalf("%s: the outbox has %d alerts, more than the page shows: the demo should raise fewer", path, len(after))
	}
	if !slices.Equal(shown, before) && !slices.Equal(shown, after) {
		c.t.Errorf("%s shows\n%q\nthe alerter's outbox holds\n%q", path, shown, after)
	}
}

// outbox returns the tenant's alerts in the alerter's outbox, sorted, each
// as "at | user | kind | limit | threshold" (the page's columns): an alert
// is one row per webhook, all with its body, raised when its first row
// was written.
func (c *console) outbox(tenant string) []string {
	c.t.Helper()
	as := c.column(`
SELECT concat(to_char(at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS"Z"'), ' | ', a->'data'->>'user', ' | ', kind, ' | ',
    a->'data'->>'limit_name', ' | ', (a->'data'->>'threshold') || '%')
FROM (SELECT min(created_at) AS at, min(kind) AS kind, min(convert_from(payload, 'UTF8'))::jsonb AS a
    FROM webhook_outbox WHERE tenant = $1 GROUP BY alert_id) o`, tenant)
	slices.Sort(as)
	return as
}

// alertsShown is how many alerts the alerts page lists at most.
const alertsShown = 50

// checkTenantToken signs out, signs in with tok (bound to own) and checks
// that it lands on own's users, that every page of the others answers 404
// without their data, and that every endpoint of the history API refuses
// them (403) while answering for own.
func (c *console) checkTenantToken(tok, own string, others []string) {
	c.t.Helper()
	if err := chromedp.Do(c.step(), chromedp.Click(".signout button"), chromedp.WaitVisible("#token")); err != nil {
		c.t.Fatalf("sign out: %v", err)
	}
	c.signIn(tok, "nav.tabs") // a tenant page: not the sign-in form still
	if loc, err := chromedp.Run(c.step(), chromedp.Location()); err != nil || loc != c.base+pagePath(own, "users") {
		c.t.Errorf("the tenant's token lands on %q (%v), want its users page", loc, err)
	}
	for _, other := range others {
		for _, p := range pages {
			path := pagePath(other, p)
			resp, err := chromedp.Run(c.step(), chromedp.NavigateResponse(c.base+path))
			if err != nil {
				c.t.Fatal(err)
			}
			body := eval[string](c, `document.body.innerText`)
			if resp.Status != 404 || strings.Contains(body, other) || eval[bool](c, `document.querySelector("table") !== null`) {
				c.t.Errorf("%s as %s's token = %d, want 404 without its data:\n%s", path, own, resp.Status, body)
			}
		}
	}
	from, to := time.Now().UTC().Add(-time.Hour).Format(time.RFC3339), time.Now().UTC().Add(time.Hour).Format(time.RFC3339)
	// Every endpoint of the history API that names a tenant, with the
	// cookie the console set.
	for _, e := range []struct {
		path string
		q    url.Values
	}{
		{"/v1/usage/history", url.Values{"from": {from}, "to": {to}}},
		{"/v1/usage/history", url.Values{"from": {from}, "to": {to}, "user": {"heavy"}}},
		{"/v1/usage/top", url.Values{"from": {from}, "to": {to}}},
		{"/v1/usage/denials", url.Values{"from": {from}, "to": {to}}},
		{"/v1/usage/windows", url.Values{"user": {"heavy"}}},
		{"/v1/usage/near", url.Values{"threshold": {"1"}}},
		{"/v1/alerts", url.Values{}},
	} {
		for _, tn := range append([]string{own}, others...) {
			e.q.Set("tenant", tn)
			u := e.path + "?" + e.q.Encode()
			code := eval[int](c, fmt.Sprintf(`fetch(%q).then(r => r.status)`, u), chromedp.EvalAwaitPromise)
			if want := map[bool]int{true: 200, false: 403}[tn == own]; code != want {
				c.t.Errorf("GET %s with %s's token's cookie = %d, want %d", u, own, code, want)
			}
		}
	}
	listed := eval[string](c, `fetch("/v1/tenants").then(r => r.text())`, chromedp.EvalAwaitPromise)
	var got struct{ Tenants []string }
	if err := json.Unmarshal([]byte(listed), &got); err != nil || !slices.Equal(got.Tenants, []string{own}) {
		c.t.Errorf("GET /v1/tenants with %s's token's cookie = %s, want its tenant alone", own, listed)
	}
}

// shot saves a PNG of the page, cropped to its content (down to the end
// of main), in every directory of c.shots.
func (c *console) shot(name string) {
	c.t.Helper()
	box := eval[[]float64](c, `[document.documentElement.clientWidth, Math.ceil(document.querySelector("main").getBoundingClientRect().bottom + window.scrollY)]`)
	t := true
	shot, err := chromedp.Call(c.step(), page.CaptureScreenshot, page.CaptureScreenshotParams{
		Clip:                  &page.Viewport{Width: box[0], Height: box[1], Scale: 1},
		CaptureBeyondViewport: &t, FromSurface: &t,
	})
	if err != nil {
		c.t.Fatalf("screenshot of %s: %v", name, err)
	}
	for _, dir := range c.shots {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			c.t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, name+".png"), shot.Data, 0o644); err != nil {
			c.t.Fatal(err)
		}
	}
}
