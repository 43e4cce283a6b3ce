package auth

import (
	"net/http"
	"net/http/httptest"
	"testing"
)

func mustEntries(t testing.TB, list ...string) []Entry {
	t.Helper()
	es, err := ParseEntries(list)
	if err != nil {
		t.Fatal(err)
	}
	return es
}

// request is a request bearing authorization (the whole header value).
func request(authorization string) *http.Request {
	r := httptest.NewRequest("GET", "/", nil)
	if authorization != "" {
		r.Header.Set("Authorization", authorization)
	}
	return r
}

func TestAuthenticate(t *testing.T) {
	a, err := New(Options{Tokens: []string{"tok-any", "tok-acme@acme#gateway", "tok-acme@beta#report"}})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, header string
		ok           bool
	}{
		{"no header", "", false},
		{"other scheme", "Basic tok-any", false},
		{"no scheme", "tok-any", false},
		{"empty token", "Bearer ", false},
		{"unknown", "Bearer nope", false},
		{"prefix", "Bearer tok-an", false},
		{"with the tenant", "Bearer tok-acme@acme", false},
		{"known", "Bearer tok-any", true},
		{"scheme in any case", "bEARER tok-any", true},
		{"padded", "Bearer   tok-any  ", true},
	} {
		if _, ok := a.Authenticate(request(tc.header)); ok != tc.ok {
			t.Errorf("%s: Authenticate(%q) ok = %v, want %v", tc.name, tc.header, ok, tc.ok)
		}
	}

	// A token listed twice grants the union of its entries.
	p, _ := a.Authenticate(request("Bearer tok-acme"))
	for _, tc := range []struct {
		role         Roles
		tenant       string
		ok, anyPlan  bool
		allowedAtAll bool
	}{
		{Gateway, "acme", true, false, true},
		{Gateway, "beta", false, false, true},
		{Report, "beta", true, false, true},
		{Report, "acme", false, false, true},
		{Billing, "acme", false, false, false},
	} {
		q := p.As(tc.role)
		ok, anyPlan := q.For(tc.tenant)
		if ok != tc.ok || anyPlan != tc.anyPlan || q.Allowed() != tc.allowedAtAll {
			t.Errorf("tok-acme as %v for %q: For = %v, %v, Allowed = %v; want %v, %v, %v",
				tc.role, tc.tenant, ok, anyPlan, q.Allowed(), tc.ok, tc.anyPlan, tc.allowedAtAll)
		}
	}
	// An entry for every tenant may name any plan, but only in its roles.
	p, _ = a.Authenticate(request("Bearer tok-any"))
	if ok, anyPlan := p.As(Report).For("zeta"); !ok || !anyPlan {
		t.Errorf("tok-any as report for zeta = %v, %v; want true, true", ok, anyPlan)
	}
	if p.As(Billing).Allowed() {
		t.Error("tok-any (gateway+report) may top up")
	}

	// No authentication: every request may do everything.
	var none *Auth
	p, ok := none.Authenticate(request(""))
	if ok2, anyPlan := p.As(Billing).For("acme"); !ok || !ok2 || !anyPlan {
		t.Errorf("nil Auth: %v, %v, %v; want everything allowed", ok, ok2, anyPlan)
	}
	// The zero Principal may do nothing.
	if ok, _ := (Principal{}).As(Gateway).For(""); ok || (Principal{}).As(Gateway).Allowed() {
		t.Error("the zero Principal is allowed something")
	}
}

func TestAuthenticateAllocs(t *testing.T) {
	a, err := New(Options{Tokens: []string{"t1", "t2@acme", "t3#billing", "t2@beta"}})
	if err != nil {
		t.Fatal(err)
	}
	r := request("Bearer t2")
	if allocs := testing.AllocsPerRun(100, func() {
		p, _ := a.Authenticate(r)
		if ok, _ := p.As(Gateway).For("beta"); !ok {
			t.Fatal("t2 not valid for beta")
		}
	}); allocs != 0 {
		t.Errorf("Authenticate allocates %v times, want 0", allocs)
	}
}

func TestNewSetUnion(t *testing.T) {
	s := NewSet(mustEntries(t, "a", "b@acme"), mustEntries(t, "b@beta#report", "c#billing"))
	if s.Len() != 3 {
		t.Errorf("Len = %d, want 3 distinct tokens", s.Len())
	}
	g, ok := s.lookup("b")
	if !ok || len(g) != 2 || g[0] != (Grant{Tenant: "acme", Roles: DefaultRoles}) || g[1] != (Grant{Tenant: "beta", Roles: Report}) {
		t.Errorf("lookup(b) = %v, %v; want its grants from both lists", g, ok)
	}
	if _, ok := s.lookup("d"); ok {
		t.Error("lookup(d) found a token")
	}
	if _, ok := NewSet().lookup(""); ok {
		t.Error("the empty set knows a token")
	}
}

func TestReads(t *testing.T) {
	a, err := New(Options{Tokens: []string{"tok-admin#admin", "tok-any", "tok-acme@acme#report", "tok-acme@beta#billing"}})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		tok      string
		tenant   string
		reads    bool
		readsAll bool
	}{
		{"tok-admin", "acme", true, true},
		{"tok-any", "acme", false, false}, // for every tenant, but not admin
		{"tok-acme", "acme", true, false},
		{"tok-acme", "beta", true, false}, // a second entry of the same token
		{"tok-acme", "gamma", false, false},
		{"tok-acme", "", false, false},
	} {
		p, ok := a.AuthenticateToken(tc.tok)
		if !ok {
			t.Fatalf("AuthenticateToken(%q) refused", tc.tok)
		}
		if p.Reads(tc.tenant) != tc.reads || p.ReadsAll() != tc.readsAll {
			t.Errorf("%s: Reads(%q), ReadsAll() = %v, %v; want %v, %v", tc.tok, tc.tenant, p.Reads(tc.tenant), p.ReadsAll(), tc.reads, tc.readsAll)
		}
	}
	p, _ := a.AuthenticateToken("tok-acme")
	if got := p.Tenants(); len(got) != 2 || got[0] != "acme" || got[1] != "beta" {
		t.Errorf("Tenants() = %v, want [acme beta]", got)
	}
	if _, ok := a.AuthenticateToken(""); ok {
		t.Error("the empty token authenticates")
	}
	if _, ok := a.AuthenticateToken("tok-acme@acme"); ok {
		t.Error("an entry's text authenticates as a token")
	}
	var none *Auth
	if p, ok := none.AuthenticateToken(""); !ok || !p.ReadsAll() {
		t.Error("without authentication, a request does not read every tenant")
	}
}
