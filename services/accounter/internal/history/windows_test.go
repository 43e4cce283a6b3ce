package history_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"quotaflow/internal/auth"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
	"quotaflow/services/accounter/internal/history"
)

// windowsWorld is a world whose policy gives tenant ten (unique to the
// test: Redis is shared) a monthly tenant-wide quota of 5000 tokens, and
// every user a daily quota of 1000 tokens and 10 requests a minute; tenToken
// reads ten only.
func windowsWorld(t *testing.T) (w *world, ten, tenToken string) {
	ten = redistest.UniqueName(t)
	tenToken = "tok-" + ten
	w = newWorld(t, tenToken+"@"+ten)
	pol, err := policy.Parse(fmt.Appendf(nil, `
default_plan: free
plans:
  free:
    quotas: [{name: daily, kind: fixed, window: 24h, limit: 1000}]
    rates: [{name: rpm, kind: rolling, window: 1m, limit: 10}]
tenants:
  %s:
    quotas: [{name: team, kind: calendar_month, limit: 5000}]
`, ten))
	if err != nil {
		t.Fatal(err)
	}
	w.pol.Store(pol)
	return w, ten, tenToken
}

// reserve reserves cost for (tenant, user) in Redis under the world's
// policy, and records the request in the ledger.
func (w *world) reserve(tenant, user string, cost int64) {
	w.t.Helper()
	rs, err := w.pol.Load().Resolve(tenant, "", "")
	if err != nil {
		w.t.Fatal(err)
	}
	id := fmt.Sprintf("r-%s-%d", user, cost)
	d, err := w.lim.Reserve(context.Background(), limits.Request{Tenant: tenant, User: user, RequestID: id, Cost: cost, Rules: rs.Subject, Counted: rs.Counted})
	if err != nil || !d.Allowed {
		w.t.Fatalf("Reserve(%s/%s, %d) = %+v, %v; want allowed", tenant, user, cost, d, err)
	}
	w.request(tenant, user, id, day0, cost, -1)
}

type windowsBody struct {
	User, Plan string
	Now        time.Time
	Windows    []history.Window
}

func TestWindows(t *testing.T) {
	w, ten, tok := windowsWorld(t)
	w.reserve(ten, "alice", 300)
	w.reserve(ten, "alice", 450)
	w.reserve(ten, "bob", 200)

	var got windowsBody
	if code := w.get(tok, "/v1/usage/windows", url.Values{"tenant": {ten}, "user": {"alice"}}, &got); code != 200 {
		t.Fatalf("windows of alice = %d", code)
	}
	day := got.Now.Truncate(24 * time.Hour).Add(24 * time.Hour) // fixed windows align to UTC days
	month := time.Date(got.Now.Year(), got.Now.Month()+1, 1, 0, 0, 0, 0, time.UTC)
	want := []string{
		fmt.Sprintf("tenant team calendar_month tokens 5000 used 950 remaining 4050 reset %s", month.Format(time.RFC3339)),
		fmt.Sprintf("user daily fixed tokens 1000 used 750 remaining 250 reset %s", day.Format(time.RFC3339)),
		"user rpm rolling requests 10 used 2 remaining 8",
	}
	// A rolling window frees its oldest bucket within the window.
	if len(got.Windows) == 3 {
		if r := got.Windows[2].Reset; r == nil || !r.After(got.Now) || r.After(got.Now.Add(time.Minute)) {
			t.Errorf("rpm's reset = %v, want within a minute of %v", r, got.Now)
		}
		got.Windows[2].Reset = nil
	}
	if g := windowStrings(got.Windows); !slices.Equal(g, want) || got.User != "alice" || got.Plan != "free" {
		t.Errorf("alice's windows = %s %s %q, want alice free %q", got.User, got.Plan, g, want)
	}

	// A user Redis knows nothing of has every window empty.
	got = windowsBody{}
	w.get(adminToken, "/v1/usage/windows", url.Values{"tenant": {ten}, "user": {"nobody"}}, &got)
	if g, d := windowStrings(got.Windows), "user daily fixed tokens 1000 used 0 remaining 1000 reset "+day.Format(time.RFC3339); len(g) != 3 || g[1] != d {
		t.Errorf("nobody's windows = %q, want %q second", g, d)
	}

	// Another tenant's token, a gateway's and none read nothing of ten.
	q := url.Values{"tenant": {ten}, "user": {"alice"}}
	for _, tc := range []struct {
		tok  string
		want int
	}{{acmeToken, 403}, {gatewayToken, 403}, {"", 401}} {
		if code := w.get(tc.tok, "/v1/usage/windows", q, nil); code != tc.want {
			t.Errorf("windows of %s with %q = %d, want %d", ten, tc.tok, code, tc.want)
		}
	}
	for _, bad := range []url.Values{{"tenant": {ten}}, {"tenant": {ten}, "user": {"a\x00"}}, {"user": {"alice"}}} {
		if code := w.get(adminToken, "/v1/usage/windows", bad, nil); code != 400 {
			t.Errorf("windows with %v = %d, want 400", bad, code)
		}
	}
}

// windowString reads each window in one line, its reset when it has one.
func windowStrings(ws []history.Window) []string {
	out := make([]string, len(ws))
	for i, w := range ws {
		out[i] = fmt.Sprintf("%s %s %s %s %d used %d remaining %d", w.Scope, w.Name, w.Kind, w.Unit, w.Limit, w.Used, w.Remaining)
		if w.Reset != nil {
			out[i] += " reset " + w.Reset.Format(time.RFC3339)
		}
	}
	return out
}

type nearBody struct {
	Tenant []history.Window
	Users  []history.UserWindows
	Next   *string
}

func TestNear(t *testing.T) {
	w, ten, tok := windowsWorld(t)
	for _, u := range []struct {
		user string
		cost int64
	}{{"u1", 900}, {"u2", 100}, {"u3", 850}, {"u4", 0}, {"u5", 1000}, {"u6", 799}} {
		w.reserve(ten, u.user, u.cost)
	}
	w.request(ten, "u7", "ledger-only", day0, -1, 5) // in the ledger, never in Redis
	other := redistest.UniqueName(t)
	w.reserve(other, "x1", 990) // another tenant: never a candidate of ten

	// 3649 of 5000 tokens: the tenant is at 72 %, not 80.
	near := func(threshold, limit int) (pages []nearBody) {
		t.Helper()
		q := url.Values{"tenant": {ten}, "threshold": {fmt.Sprint(threshold)}, "limit": {fmt.Sprint(limit)}}
		for range 10 {
			var got nearBody
			if code := w.get(tok, "/v1/usage/near", q, &got); code != 200 {
				t.Fatalf("near %v = %d", q, code)
			}
			pages = append(pages, got)
			if got.Next == nil {
				return pages
			}
			q.Set("after", *got.Next)
		}
		t.Fatalf("near %v: more than 10 pages", q)
		return nil
	}
	pages := near(80, 2)
	var users, nexts []string
	for _, p := range pages {
		for _, s := range p.Users {
			users = append(users, s.User+":"+fmt.Sprint(windowStrings(s.Windows)))
		}
		if p.Next != nil {
			nexts = append(nexts, *p.Next)
		}
		if len(p.Tenant) != 0 {
			t.Errorf("tenant at 72 %% reported near 80 %%: %v", p.Tenant)
		}
	}
	day := func(used int64) string {
		return fmt.Sprint([]string{fmt.Sprintf("user daily fixed tokens 1000 used %d remaining %d reset %s", used, 1000-used,
			pages[0].Users[0].Windows[0].Reset.Format(time.RFC3339))})
	}
	want := []string{"u1:" + day(900), "u3:" + day(850), "u5:" + day(1000)}
	if !slices.Equal(users, want) || !slices.Equal(nexts, []string{"u2", "u4", "u6"}) {
		t.Errorf("near 80 %% by pages of 2 = %q, nexts %q; want %q, nexts [u2 u4 u6]", users, nexts, want)
	}

	// A page exactly full with nothing after it is the last: no next.
	if pages := near(80, 7); len(pages) != 1 || len(pages[0].Users) != 3 {
		t.Errorf("near 80 %% by a page of all 7 users = %d pages %+v, want one page of 3", len(pages), pages)
	}

	// At 70 % the tenant is near too, on the first page only.
	pages = near(70, 500)
	if len(pages) != 1 || len(pages[0].Tenant) != 1 || pages[0].Tenant[0].Name != "team" || pages[0].Tenant[0].Used != 3649 || len(pages[0].Users) != 4 {
		t.Errorf("near 70 %% = %+v, want the tenant's team at 3649 and u1, u3, u5, u6", pages)
	}

	q := url.Values{"tenant": {ten}, "threshold": {"80"}}
	if code := w.get(acmeToken, "/v1/usage/near", q, nil); code != 403 {
		t.Errorf("near of %s with acme's token = %d, want 403", ten, code)
	}
	q.Set("tenant", other)
	if code := w.get(tok, "/v1/usage/near", q, nil); code != 403 {
		t.Errorf("near of another tenant with %s's token = %d, want 403", ten, code)
	}
	for _, bad := range []url.Values{{}, {"threshold": {"0"}}, {"threshold": {"101"}}, {"threshold": {"8o"}},
		{"threshold": {"80"}, "limit": {"501"}}, {"threshold": {"80"}, "offset": {"1"}}, {"threshold": {"80"}, "after": {"a\x7f"}}} {
		bad.Set("tenant", ten)
		if code := w.get(adminToken, "/v1/usage/near", bad, nil); code != 400 {
			t.Errorf("near with %v = %d, want 400", bad, code)
		}
	}
}

// TestWindowsRedisDown: windows Redis cannot give answer 503, naming
// Redis and not its error; the ledger's lists still answer.
func TestWindowsRedisDown(t *testing.T) {
	w, ten, _ := windowsWorld(t)
	w.request(ten, "alice", "r1", day0, 10, -1)
	down := redistest.Start(t)
	c := down.Client()
	down.Stop()
	rd := history.NewReader(w.pool, 0, history.WindowsSource{Limiter: limits.New(c, limits.Options{NoEpochGuard: true}), Policy: w.pol.Load})
	srv := httptest.NewServer(history.NewHandler(history.Options{Reader: rd}))
	defer srv.Close()
	for _, path := range []string{"/v1/usage/windows?user=alice&tenant=", "/v1/usage/near?threshold=1&tenant="} {
		resp, err := srv.Client().Get(srv.URL + path + ten)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 503 || !strings.Contains(string(b), "Redis could not be read") || strings.Contains(string(b), down.Addr) {
			t.Errorf("GET %s with Redis down = %d %s, want 503 naming Redis, not its address", path, resp.StatusCode, b)
		}
	}
}

// planWorld is a world whose tenant ten is on free (a daily quota of 1000
// tokens) and granted pro (a daily quota of a million and an hourly one of
// 2000), and whose policy has enterprise, granted to nobody.
func planWorld(t *testing.T) (w *world, ten, tok string) {
	ten = redistest.UniqueName(t)
	tok = "tok-" + ten
	w = newWorld(t, tok+"@"+ten)
	pol, err := policy.Parse(fmt.Appendf(nil, `
default_plan: free
plans:
  free:
    quotas: [{name: daily, kind: fixed, window: 24h, limit: 1000}]
  pro:
    quotas: [{name: daily, kind: fixed, window: 24h, limit: 1000000}, {name: hourly, kind: fixed, window: 1h, limit: 2000}]
  enterprise: {}
tenants:
  %s: {plans: [pro]}
`, ten))
	if err != nil {
		t.Fatal(err)
	}
	w.pol.Store(pol)
	return w, ten, tok
}

// reserveOn reserves cost as admission would for a request of (tenant,
// user) on plan to endpoint, and records it in the ledger; it returns
// whether admission admitted it.
func (w *world) reserveOn(tenant, user, plan, endpoint, id string, cost int64) bool {
	w.t.Helper()
	rs, err := w.pol.Load().Resolve(tenant, plan, endpoint)
	if err != nil {
		w.t.Fatal(err)
	}
	d, err := w.lim.Reserve(context.Background(), limits.Request{Tenant: tenant, User: user, RequestID: id, Cost: cost, Rules: rs.Subject, Counted: rs.Counted})
	if err != nil {
		w.t.Fatal(err)
	}
	w.request(tenant, user, id, day0, cost, -1)
	return d.Allowed
}

// TestWindowsPlan: windows and near read the plan plan= names, as
// admission's GET /v1/usage does, so a user of a granted plan is read
// against that plan's sizes; a tenant's token names only its plans.
func TestWindowsPlan(t *testing.T) {
	w, ten, tok := planWorld(t)
	if !w.reserveOn(ten, "bob", "pro", "", "b1", 1500) {
		t.Fatal("pro denied 1500")
	}
	windows := func(token, plan string) (string, []string) {
		t.Helper()
		var got windowsBody
		if code := w.get(token, "/v1/usage/windows", url.Values{"tenant": {ten}, "user": {"bob"}, "plan": {plan}}, &got); code != 200 {
			t.Fatalf("windows of bob on %q = %d", plan, code)
		}
		g := windowStrings(got.Windows)
		for i := range g {
			g[i], _, _ = strings.Cut(g[i], " reset ")
		}
		return got.Plan, g
	}
	if plan, g := windows(tok, "pro"); plan != "pro" || !slices.Equal(g, []string{
		"user daily fixed tokens 1000000 used 1500 remaining 998500", "user hourly fixed tokens 2000 used 1500 remaining 500"}) {
		t.Errorf("bob on pro = %s %q", plan, g)
	}
	// The tenant's own plan shares pro's daily record (limits are kept by
	// scope, name, kind and window: docs/design.md §6).
	if plan, g := windows(tok, ""); plan != "free" || !slices.Equal(g, []string{"user daily fixed tokens 1000 used 1500 remaining 0"}) {
		t.Errorf("bob on the tenant's own plan = %s %q", plan, g)
	}
	if plan, _ := windows(adminToken, "enterprise"); plan != "enterprise" {
		t.Errorf("an admin reads enterprise as %q", plan)
	}

	near := func(plan, threshold string) (users []string) {
		t.Helper()
		var got nearBody
		if code := w.get(tok, "/v1/usage/near", url.Values{"tenant": {ten}, "plan": {plan}, "threshold": {threshold}}, &got); code != 200 {
			t.Fatalf("near on %q = %d", plan, code)
		}
		for _, u := range got.Users {
			for _, x := range u.Windows {
				users = append(users, u.User+" "+x.Name)
			}
		}
		return users
	}
	if g := near("pro", "100"); len(g) != 0 {
		t.Errorf("near 100 %% on pro = %q, want none: bob has 998500 left", g)
	}
	if g := near("pro", "75"); !slices.Equal(g, []string{"bob hourly"}) {
		t.Errorf("near 75 %% on pro = %q, want bob's hourly", g)
	}
	if g := near("", "100"); !slices.Equal(g, []string{"bob daily"}) {
		t.Errorf("near 100 %% on free = %q, want bob's daily", g)
	}

	// Admission's rule: a tenant's token names its own plans only, an admin
	// any plan of the policy.
	for _, tc := range []struct {
		tok, plan string
		want      int
	}{{tok, "enterprise", 403}, {tok, "gold", 403}, {adminToken, "gold", 400}, {adminToken, "a\x00", 400}, {tok, "free", 200}} {
		for _, path := range []string{"/v1/usage/windows", "/v1/usage/near"} {
			q := url.Values{"tenant": {ten}, "user": {"bob"}, "plan": {tc.plan}, "threshold": {"80"}}
			if code := w.get(tc.tok, path, q, nil); code != tc.want {
				t.Errorf("%s on plan %q with %s = %d, want %d", path, tc.plan, tc.tok, code, tc.want)
			}
		}
	}
}

// TestWindowsEndpointUserLimit: an endpoint's per-user limit, which
// admission enforces on the user's requests to it, is among the user's
// windows and near when full.
func TestWindowsEndpointUserLimit(t *testing.T) {
	ten := redistest.UniqueName(t)
	tok := "tok-" + ten
	w := newWorld(t, tok+"@"+ten)
	pol, err := policy.Parse(fmt.Appendf(nil, `
default_plan: free
plans:
  free:
    quotas: [{name: daily, kind: fixed, window: 24h, limit: 1000000}]
endpoints:
  /gen:
    user: [{name: gen-hourly, kind: fixed, window: 1h, limit: 1, unit: requests}]
  /other: {}
tenants:
  %s: {}
`, ten))
	if err != nil {
		t.Fatal(err)
	}
	w.pol.Store(pol)
	if !w.reserveOn(ten, "alice", "", "/gen", "a1", 10) {
		t.Fatal("alice's first /gen request denied")
	}
	if w.reserveOn(ten, "alice", "", "/gen", "a2", 1) {
		t.Fatal("admission admits alice's second /gen request in the hour")
	}
	var win windowsBody
	w.get(tok, "/v1/usage/windows", url.Values{"tenant": {ten}, "user": {"alice"}}, &win)
	if len(win.Windows) != 2 || win.Windows[1].Endpoint != "/gen" || win.Windows[0].Endpoint != "" ||
		!slices.Equal(windowStrings(win.Windows)[1:], []string{"user gen-hourly fixed requests 1 used 1 remaining 0 reset " + win.Windows[1].Reset.Format(time.RFC3339)}) {
		t.Errorf("alice's windows = %+v, want daily then /gen's gen-hourly 1 of 1", win.Windows)
	}
	var got nearBody
	if code := w.get(tok, "/v1/usage/near", url.Values{"tenant": {ten}, "threshold": {"100"}}, &got); code != 200 {
		t.Fatalf("near = %d", code)
	}
	if len(got.Users) != 1 || got.Users[0].User != "alice" || len(got.Users[0].Windows) != 1 ||
		got.Users[0].Windows[0].Endpoint != "/gen" || got.Users[0].Windows[0].Name != "gen-hourly" {
		t.Errorf("near 100 %% = %+v, want alice's /gen gen-hourly", got.Users)
	}
}

// TestNearUnreadableUser: a ledger user whose windows cannot be read (an
// id longer than admission accepts) is marked on its page, not a 503 of
// the page, and a page's next past it is accepted.
func TestNearUnreadableUser(t *testing.T) {
	w, ten, tok := windowsWorld(t)
	long := "u2" + strings.Repeat("x", 300)
	w.reserve(ten, "u1", 900)
	w.request(ten, long, "long", day0, 5, -1)
	w.reserve(ten, "u3", 950)
	var users []string
	q := url.Values{"tenant": {ten}, "threshold": {"80"}, "limit": {"1"}}
	for range 5 {
		var got nearBody
		if code := w.get(tok, "/v1/usage/near", q, &got); code != 200 {
			t.Fatalf("near %v = %d", q, code)
		}
		for _, u := range got.Users {
			users = append(users, fmt.Sprintf("%.2s %d %q", u.User, len(u.Windows), u.Error))
		}
		if got.Next == nil {
			break
		}
		q.Set("after", *got.Next)
	}
	want := []string{`u1 1 ""`, `u2 0 "not an identifier admission accepts: its windows cannot be read"`, `u3 1 ""`}
	if !slices.Equal(users, want) {
		t.Errorf("near by pages of 1 = %q, want %q", users, want)
	}
	if code := w.get(tok, "/v1/usage/windows", url.Values{"tenant": {ten}, "user": {long}}, nil); code != 400 {
		t.Errorf("windows of a user longer than an identifier = %d, want 400", code)
	}
}

// blockingPeeker is the Limiter, holding each PeekBatch until release is
// closed; the first says on started that it began.
type blockingPeeker struct {
	lim              *limits.Limiter
	started, release chan struct{}
}

func (b blockingPeeker) PeekBatch(ctx context.Context, rs []limits.Request) []limits.Reserved {
	select {
	case b.started <- struct{}{}:
	default:
	}
	<-b.release
	return b.lim.PeekBatch(ctx, rs)
}

// TestWindowsBusy: reads of Redis beyond MaxPeeks at once answer 503 with
// Retry-After at once, and are served again when one ends.
func TestWindowsBusy(t *testing.T) {
	w, ten, tok := windowsWorld(t)
	w.reserve(ten, "alice", 10)
	bp := blockingPeeker{lim: w.lim, started: make(chan struct{}, 1), release: make(chan struct{})}
	rd := history.NewReader(w.pool, 0, history.WindowsSource{Limiter: bp, Policy: w.pol.Load, MaxPeeks: 1})
	a, err := auth.New(auth.Options{Tokens: []string{tok + "@" + ten}})
	if err != nil {
		t.Fatal(err)
	}
	w.srv = httptest.NewServer(history.NewHandler(history.Options{Reader: rd, Auth: a}))
	defer w.srv.Close()
	q := url.Values{"tenant": {ten}, "user": {"alice"}}
	first := make(chan int)
	go func() { first <- w.get(tok, "/v1/usage/windows", q, nil) }()
	<-bp.started
	resp, err := w.srv.Client().Do(func() *http.Request {
		r, _ := http.NewRequest("GET", w.srv.URL+"/v1/usage/near?threshold=1&tenant="+ten, nil)
		r.Header.Set("Authorization", "Bearer "+tok)
		return r
	}())
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") != "1" {
		t.Errorf("near while a read is under way = %d, Retry-After %q; want 503, 1", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	close(bp.release)
	if code := <-first; code != 200 {
		t.Errorf("the read under way = %d, want 200", code)
	}
	if code := w.get(tok, "/v1/usage/windows", q, nil); code != 200 {
		t.Errorf("windows after the read ended = %d, want 200", code)
	}
}
