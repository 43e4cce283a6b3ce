package console

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"quotaflow/internal/auth"
)

// testTokens are an admin's, one bound to tenant "a" and a platform
// gateway's, which reads no tenant.
var testTokens = []string{"admin-tok#admin", "a-tok@a", "gw-tok"}

// ledger is a fake Source recording the tenants it was asked about.
type ledger struct{ asked []string }

// Tenants gives a first page of a and b, then c.
func (l *ledger) Tenants(_ context.Context, after string) (Tenants, error) {
	if after == "" {
		return Tenants{Tenants: []string{"a", "b"}, Next: "b"}, nil
	}
	return Tenants{Tenants: []string{"c"}}, nil
}

// Users gives tenant a two plans, free (its own) and pro, and every other
// tenant free only; plan gold is none of the policy's.
func (l *ledger) Users(_ context.Context, t, plan, after string) (Subjects, error) {
	l.asked = append(l.asked, t)
	plans := []string{"free"}
	if t == "a" {
		plans = append(plans, "pro")
	}
	switch plan {
	case "":
		plan = "free"
	case "gold":
		return Subjects{}, ErrUnknownPlan
	}
	if after == "bare" { // a user whose plan has no user limits
		return Subjects{Plan: plan, Plans: plans, Users: []User{{User: "bare-user"}}}, nil
	}
	s := Subjects{Plan: plan, Plans: plans, Users: []User{{User: t + "-user" + after, Windows: []Window{{Name: "user quota", Limit: 10, Used: 7, Remaining: 3},
		{Name: "user requests-per-day-of-v1-chat-completions", Limit: 100, Used: 1, Remaining: 99, Reset: time.Unix(86400, 0)}}},
		{User: t + "-odd", Error: "cannot be read: too long"}}}
	if after == "" {
		s.Tenant = []Window{{Name: "tenant monthly", Limit: 1000, Used: 900, Remaining: 100, Reset: time.Unix(2*86400, 0)}}
		s.Next = t + "-user"
	}
	return s, nil
}
func (l *ledger) Near(ctx context.Context, t, plan string, threshold int, after string) (Subjects, error) {
	s, err := l.Users(ctx, t, plan, after)
	if err != nil {
		return s, err
	}
	s.Users[0].Windows = s.Users[0].Windows[:1]
	s.Users[0].User += fmt.Sprint("-near", threshold)
	return s, nil
}
func (l *ledger) History(_ context.Context, t, _ string, _, _ time.Time, _ Step) ([]Point, error) {
	l.asked = append(l.asked, t)
	return []Point{{Start: time.Unix(3600, 0), Tokens: 11, Requests: 2}}, nil
}
func (l *ledger) TopUsers(_ context.Context, t string, _, _ time.Time, _ int) ([]UserTotal, error) {
	l.asked = append(l.asked, t)
	return nil, nil
}
func (l *ledger) Denials(_ context.Context, t string, _, _ time.Time) ([]Denial, error) {
	l.asked = append(l.asked, t)
	return nil, nil
}
func (l *ledger) Alerts(_ context.Context, t string, _ int) ([]Alert, error) {
	l.asked = append(l.asked, t)
	return nil, nil
}

func newTestServer(t *testing.T) (*httptest.Server, *ledger) {
	t.Helper()
	src := &ledger{}
	a, err := auth.New(auth.Options{Tokens: testTokens})
	if err != nil {
		t.Fatal(err)
	}
	h := New(Options{Auth: a, Source: src, Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv, src
}

// noRedirect is a client that shows redirects instead of following them.
var noRedirect = &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}

func signin(t *testing.T, srv *httptest.Server, tok string, hdr map[string]string) *http.Response {
	t.Helper()
	return post(t, srv, "/signin", tok, hdr)
}

// post posts the form of token tok to path with headers hdr.
func post(t *testing.T, srv *httptest.Server, path, tok string, hdr map[string]string) *http.Response {
	t.Helper()
	req, _ := http.NewRequest("POST", srv.URL+path, strings.NewReader(url.Values{"token": {tok}}.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := noRedirect.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp
}

// TestCookieSecureBehindTLSProxy: the console is served over plain HTTP
// and reached over https through a proxy that ends TLS; the cookie holding
// the token must then be Secure, on sign-in and sign-out.
func TestCookieSecureBehindTLSProxy(t *testing.T) {
	srv, _ := newTestServer(t)
	for _, hdr := range []map[string]string{
		{"X-Forwarded-Proto": "https"},
		{"X-Forwarded-Proto": "HTTPS, http"},
		{"Forwarded": `for=192.0.2.60;proto=https;by=203.0.113.43`},
		{"Forwarded": `proto="https", proto=http`},
	} {
		hdr["Sec-Fetch-Site"] = "same-origin"
		for _, path := range []string{"/signin", "/signout"} {
			if cs := post(t, srv, path, "a-tok", hdr).Cookies(); len(cs) != 1 || !cs[0].Secure {
				t.Errorf("POST %s with %v: cookies %v, want one Secure", path, hdr, cs)
			}
		}
	}
	for _, hdr := range []map[string]string{{"X-Forwarded-Proto": "http"}, {"Forwarded": "for=192.0.2.60;proto=http"}, {"X-Forwarded-Proto": "http, https"}} {
		hdr["Sec-Fetch-Site"] = "same-origin"
		if cs := signin(t, srv, "a-tok", hdr).Cookies(); len(cs) != 1 || cs[0].Secure {
			t.Errorf("sign-in with %v: cookies %v, want one, not Secure", hdr, cs)
		}
	}
}

func TestSignin(t *testing.T) {
	srv, _ := newTestServer(t)
	resp := signin(t, srv, "a-tok", map[string]string{"Sec-Fetch-Site": "same-origin"})
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("POST /signin = %d, want 303", resp.StatusCode)
	}
	cs := resp.Cookies()
	if len(cs) != 1 {
		t.Fatalf("cookies = %v, want one", cs)
	}
	c := cs[0]
	if c.Name != CookieName || c.Value != "a-tok" || !c.HttpOnly || c.SameSite != http.SameSiteStrictMode || c.Path != "/" || c.Secure {
		t.Errorf("cookie = %+v, want %s=a-tok HttpOnly SameSite=Strict Path=/ (not Secure over plain HTTP)", c, CookieName)
	}

	for _, tc := range []struct {
		name string
		tok  string
		hdr  map[string]string
		want int
	}{
		{"unknown token", "nope", nil, http.StatusUnauthorized},
		{"token reading no tenant", "gw-tok", nil, http.StatusUnauthorized},
		{"empty token", "  ", nil, http.StatusBadRequest},
		{"cross-site post", "a-tok", map[string]string{"Sec-Fetch-Site": "cross-site"}, http.StatusForbidden},
		{"other origin", "a-tok", map[string]string{"Origin": "http://evil.example"}, http.StatusForbidden},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp := signin(t, srv, tc.tok, tc.hdr)
			if resp.StatusCode != tc.want || len(resp.Cookies()) != 0 {
				t.Errorf("POST /signin = %d with cookies %v, want %d and none", resp.StatusCode, resp.Cookies(), tc.want)
			}
		})
	}
}

func get(t *testing.T, srv *httptest.Server, path, tok string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest("GET", srv.URL+path, nil)
	if tok != "" {
		req.AddCookie(&http.Cookie{Name: CookieName, Value: tok})
	}
	resp, err := noRedirect.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

// TestTenantScope checks that a tenant's token reaches its own pages and
// no other tenant's, whatever the URL says, and that the source is never
// asked about a tenant the token may not see.
func TestTenantScope(t *testing.T) {
	srv, src := newTestServer(t)
	pages := []string{"", "/near", "/usage", "/top", "/denials", "/alerts"}
	for _, p := range pages {
		if resp, body := get(t, srv, "/tenants/a"+p, "a-tok"); resp.StatusCode != 200 {
			t.Errorf("GET /tenants/a%s as a = %d %s, want 200", p, resp.StatusCode, body)
		}
		for _, other := range []string{"b", "%2e%2e", "a%00", "A"} {
			resp, body := get(t, srv, "/tenants/"+other+p, "a-tok")
			if resp.StatusCode != http.StatusNotFound || strings.Contains(body, "b-user") {
				t.Errorf("GET /tenants/%s%s as a = %d, want 404 and nothing of it", other, p, resp.StatusCode)
			}
		}
		if resp, _ := get(t, srv, "/tenants/b"+p, "admin-tok"); resp.StatusCode != 200 {
			t.Errorf("GET /tenants/b%s as admin = %d, want 200", p, resp.StatusCode)
		}
		if resp, _ := get(t, srv, "/tenants/a"+p, ""); resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/signin" {
			t.Errorf("GET /tenants/a%s signed out = %d to %q, want 303 to /signin", p, resp.StatusCode, resp.Header.Get("Location"))
		}
	}
	for _, asked := range src.asked {
		if asked != "a" && asked != "b" {
			t.Errorf("source asked about tenant %q", asked)
		}
	}
	// A tenant's token lands on its tenant; the admin's on the list.
	if resp, _ := get(t, srv, "/", "a-tok"); resp.Header.Get("Location") != "/tenants/a" {
		t.Errorf("GET / as a: Location %q, want /tenants/a", resp.Header.Get("Location"))
	}
	if resp, body := get(t, srv, "/", "admin-tok"); resp.StatusCode != 200 || !strings.Contains(body, `href="/tenants/b"`) {
		t.Errorf("GET / as admin = %d, want 200 listing tenant b", resp.StatusCode)
	}
	// The admin's tenants come a page at a time.
	if resp, body := get(t, srv, "/", "admin-tok"); resp.StatusCode != 200 || !strings.Contains(body, `<a id="next" href="/?after=b">`) {
		t.Errorf("GET / as admin = %d, want a link to the tenants after b:\n%s", resp.StatusCode, body)
	}
	if resp, body := get(t, srv, "/?after=b", "admin-tok"); resp.StatusCode != 200 || !strings.Contains(body, `href="/tenants/c"`) || strings.Contains(body, `id="next"`) {
		t.Errorf("GET /?after=b as admin = %d, want tenant c and no next page:\n%s", resp.StatusCode, body)
	}
	if resp, _ := get(t, srv, "/?after=%01", "admin-tok"); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("GET /?after=%%01 = %d, want 400", resp.StatusCode)
	}
	if resp, _ := get(t, srv, "/tenants/a/usage?range=1y", "a-tok"); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("GET ?range=1y = %d, want 400", resp.StatusCode)
	}
}

// TestHeaders checks the policy every answer carries: no script, style or
// connection to another origin, no framing.
func TestHeaders(t *testing.T) {
	srv, _ := newTestServer(t)
	for _, p := range []string{"/signin", "/tenants/a/usage", "/static/chart.js", "/static/uplot-1.6.32/uPlot.iife.min.js"} {
		resp, _ := get(t, srv, p, "a-tok")
		if resp.StatusCode != 200 {
			t.Errorf("GET %s = %d, want 200", p, resp.StatusCode)
		}
		if got := resp.Header.Get("Content-Security-Policy"); got != csp {
			t.Errorf("GET %s: Content-Security-Policy %q, want %q", p, got, csp)
		}
		if got := resp.Header.Get("X-Content-Type-Options"); got != "nosniff" {
			t.Errorf("GET %s: X-Content-Type-Options %q", p, got)
		}
	}
	_, body := get(t, srv, "/tenants/a/usage", "a-tok")
	if !strings.Contains(body, `data-points="[[3600],[11],[2]]"`) {
		t.Errorf("usage page lacks the chart's points:\n%s", body)
	}
}

// TestSubjects checks the users and near pages: every window the source
// gives, in its table, the tenant's own limits on the first page only, a
// link to the next page that keeps the threshold, and 400 for a bad
// threshold or page.
func TestSubjects(t *testing.T) {
	srv, _ := newTestServer(t)
	for _, tc := range []struct {
		path string
		want []string
		not  []string
	}{
		{"/tenants/a", []string{`id="tenant-windows"`, `<tr data-limit="tenant monthly"><th scope="row">tenant monthly</th><td class="num used">900</td><td class="num limit">1000</td><td class="num remaining">100</td><td class="reset">1970-01-03 00:00:00Z</td>`,
			`data-user="a-user" data-limit="user quota"`, `<td class="num used">7</td><td class="num limit">10</td><td class="num remaining">3</td><td class="reset">—</td>`,
			`data-user="a-user" data-limit="user requests-per-day-of-v1-chat-completions"`, `href="/tenants/a?after=a-user"`}, nil},
		{"/tenants/a?after=a-user", []string{`data-user="a-usera-user"`}, []string{`id="tenant-windows"`, `id="next"`}},
		{"/tenants/a?after=bare", []string{`<tr data-user="bare-user" class="no-limits"><th scope="row">bare-user</th><td colspan="5">no user limits</td></tr>`}, []string{`id="no-users"`}},
		{"/tenants/a/near", []string{`data-user="a-user-near80"`, `value="80"`, `href="/tenants/a/near?after=a-user&amp;threshold=80"`}, []string{"requests-per-day"}},
		{"/tenants/a/near?threshold=95&after=x", []string{`data-user="a-userx-near95"`}, []string{`id="next"`}},
		// A tenant with two plans gets a choice of them, the shown one
		// selected, and its next page keeps the plan.
		{"/tenants/a", []string{`Limits of plan <strong>free</strong>, one of the tenant's 2 plans`, `<option value="free" selected>free</option><option value="pro">pro</option>`}, nil},
		{"/tenants/a?plan=pro", []string{`Limits of plan <strong>pro</strong>`, `<option value="pro" selected>pro</option>`, `href="/tenants/a?after=a-user&amp;plan=pro"`}, nil},
		{"/tenants/a/near?plan=pro", []string{`<option value="pro" selected>pro</option>`, `href="/tenants/a/near?after=a-user&amp;plan=pro&amp;threshold=80"`}, nil},
		// A user whose windows could not be read is listed with why.
		{"/tenants/a", []string{`<tr data-user="a-odd"><th scope="row">a-odd</th><td colspan="5" class="error">cannot be read: too long</td></tr>`}, nil},
	} {
		resp, body := get(t, srv, tc.path, "a-tok")
		if resp.StatusCode != 200 {
			t.Errorf("GET %s = %d, want 200", tc.path, resp.StatusCode)
		}
		for _, w := range tc.want {
			if !strings.Contains(body, w) {
				t.Errorf("GET %s lacks %s:\n%s", tc.path, w, body)
			}
		}
		for _, n := range tc.not {
			if strings.Contains(body, n) {
				t.Errorf("GET %s shows %s:\n%s", tc.path, n, body)
			}
		}
	}
	for _, p := range []string{"/tenants/a/near?threshold=0", "/tenants/a/near?threshold=101", "/tenants/a/near?threshold=8o", "/tenants/a/near?after=%01", "/tenants/a?after=%ff",
		"/tenants/a?plan=gold", "/tenants/a/near?plan=gold", "/tenants/a?plan=%01"} {
		if resp, _ := get(t, srv, p, "a-tok"); resp.StatusCode != http.StatusBadRequest {
			t.Errorf("GET %s = %d, want 400", p, resp.StatusCode)
		}
	}
}
