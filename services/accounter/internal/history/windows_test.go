package history_test

import (
	"context"
	"fmt"
	"io"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

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
	rd := history.NewReader(w.pool, history.WindowsSource{Limiter: limits.New(c, limits.Options{NoEpochGuard: true}), Policy: w.pol.Load})
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
