package httpapi

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"quotaflow/internal/auth"
	"quotaflow/internal/auth/authtest"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
	"quotaflow/services/admission/internal/decide"
)

// withAuth sets the API's Auth to one built from o (logging to the test's
// log).
func withAuth(t testing.TB, o auth.Options) func(*Options) {
	return func(opts *Options) {
		o.Log = opts.Log
		a, err := auth.New(o)
		if err != nil {
			t.Fatalf("auth.New = %v", err)
		}
		opts.Auth = a
	}
}

// answering makes every Decider method and the events sink succeed.
func (e *env) answering() *env {
	e.dec.admit = allowed
	e.dec.release = func(string, string, string) (limits.Settlement, error) {
		return limits.Settlement{Status: limits.Settled, Now: testNow}, nil
	}
	e.dec.usage = func(string, string, string) ([]decide.LimitState, error) { return userLimits(10), nil }
	e.dec.topUp = func(string, string, int64, string) (limits.TopUpResult, error) {
		return limits.TopUpResult{Applied: true, Credited: 5}, nil
	}
	return e
}

// route is one API route, called for tenant.
type route struct {
	name string
	call func(e *env, tenant string, hdr ...string) int
}

var routes = []route{
	{"admit", func(e *env, tenant string, hdr ...string) int {
		return e.do("POST", "/v1/admit", `{"tenant":"`+tenant+`","user":"u","endpoint":"/e"}`, hdr...).Code
	}},
	{"authz", func(e *env, tenant string, hdr ...string) int {
		return e.do("GET", "/v1/authz/e", "", append(hdr, hdrTenant, tenant, hdrUser, "u")...).Code
	}},
	{"release", func(e *env, tenant string, hdr ...string) int {
		return e.do("POST", "/v1/release", `{"tenant":"`+tenant+`","user":"u","request_id":"r"}`, hdr...).Code
	}},
	{"usage query", func(e *env, tenant string, hdr ...string) int {
		return e.do("GET", "/v1/usage?tenant="+tenant+"&user=u", "", hdr...).Code
	}},
	{"usage report", func(e *env, tenant string, hdr ...string) int {
		return e.do("POST", "/v1/usage", "["+actualJSON("e1", tenant, 5)+"]", hdr...).Code
	}},
	{"topup", func(e *env, tenant string, hdr ...string) int {
		return e.do("POST", "/v1/balances/topup", `{"tenant":"`+tenant+`","user":"u","amount":5,"reference":"r"}`, hdr...).Code
	}},
}

// bearer is the Authorization header of tok.
func bearer(tok string) []string { return []string{"Authorization", "Bearer " + tok} }

// TestRolesByRoute: each role × each route, allowed or 403, for a token
// of every tenant and for one bound to the request's tenant.
func TestRolesByRoute(t *testing.T) {
	e := newEnv(t, withAuth(t, auth.Options{Tokens: []string{
		"s3cret-gateway#gateway", "s3cret-report#report", "s3cret-billing#billing", "s3cret-admin#admin",
		"s3cret-default", "s3cret-acme@acme", "s3cret-acme-billing@acme#billing", "s3cret-all#gateway+report+billing",
	}})).answering()
	all := []string{"admit", "authz", "release", "usage query", "usage report", "topup"}
	gateway := []string{"admit", "authz", "release", "usage query"}
	for _, tc := range []struct {
		token   string
		allowed []string
	}{
		{"s3cret-gateway", gateway},
		{"s3cret-report", []string{"usage report"}},
		{"s3cret-billing", []string{"topup"}},
		{"s3cret-admin", all},
		{"s3cret-default", append(slices.Clone(gateway), "usage report")}, // gateway+report: no top-ups
		{"s3cret-acme", append(slices.Clone(gateway), "usage report")},
		{"s3cret-acme-billing", []string{"topup"}},
		{"s3cret-all", all},
	} {
		for _, rt := range routes {
			code := rt.call(e, "acme", bearer(tc.token)...)
			want := "allowed"
			if !slices.Contains(tc.allowed, rt.name) {
				want = "403"
			}
			got := "allowed"
			switch {
			case code == http.StatusForbidden:
				got = "403"
			case code >= 300:
				got = fmt.Sprint(code)
			}
			if got != want {
				t.Errorf("%s on %s = %d, want %s", tc.token, rt.name, code, want)
			}
		}
	}
	// A token lacking the route's role is refused before its request is
	// read: a caller learns nothing from validation errors either.
	for _, tc := range []struct{ token, method, target, body string }{
		{"s3cret-report", "POST", "/v1/admit", "not json"},
		{"s3cret-billing", "GET", "/v1/usage?user=u", ""},
		{"s3cret-default", "POST", "/v1/balances/topup", `{"tenant":"acme"}`},
		{"s3cret-gateway", "POST", "/v1/usage", "[]"},
	} {
		if w := e.do(tc.method, tc.target, tc.body, bearer(tc.token)...); w.Code != http.StatusForbidden {
			t.Errorf("%s %s %s by %s = %d %s, want 403", tc.method, tc.target, tc.body, tc.token, w.Code, w.Body)
		}
	}
	// A request without a valid token is 401 on every route, whatever its role.
	for _, rt := range routes {
		if code := rt.call(e, "acme", bearer("s3cret-unknown")...); code != http.StatusUnauthorized {
			t.Errorf("unknown token on %s = %d, want 401", rt.name, code)
		}
	}
	authtest.NoSecrets(t, "the logs", e.logs.String(), "s3cret-gateway", "s3cret-report", "s3cret-billing", "s3cret-admin",
		"s3cret-default", "s3cret-acme", "s3cret-all", "s3cret-unknown")
}

// TestTenantBinding: a token bound to a tenant acts for that tenant only,
// on every route its roles allow; an admin and an unbound token for any.
func TestTenantBinding(t *testing.T) {
	e := newEnv(t, withAuth(t, auth.Options{Tokens: []string{
		"s3cret-acme@acme#gateway+report+billing", "s3cret-any#gateway+report+billing", "s3cret-admin#admin",
	}})).answering()
	for _, rt := range routes {
		for _, tc := range []struct {
			token, tenant string
			want          bool
		}{
			{"s3cret-acme", "acme", true},
			{"s3cret-acme", "beta", false},
			{"s3cret-acme", "acm", false},
			{"s3cret-acme", "ACME", false},
			{"s3cret-any", "beta", true},
			{"s3cret-admin", "beta", true},
		} {
			code := rt.call(e, tc.tenant, bearer(tc.token)...)
			if (code < 300) != tc.want || !tc.want && code != http.StatusForbidden {
				t.Errorf("%s for %s on %s = %d, want allowed %v (else 403)", tc.token, tc.tenant, rt.name, code, tc.want)
			}
		}
	}
	// The 403 says nothing of what the token lacks: the same body for a
	// missing role and a wrong tenant.
	wrongTenant := e.do("POST", "/v1/admit", `{"tenant":"beta","user":"u","endpoint":"/e"}`, bearer("s3cret-acme")...)
	e2 := newEnv(t, withAuth(t, auth.Options{Tokens: []string{"s3cret-report#report"}}))
	wrongRole := e2.do("POST", "/v1/admit", `{"tenant":"beta","user":"u","endpoint":"/e"}`, bearer("s3cret-report")...)
	if wrongTenant.Body.String() != wrongRole.Body.String() || wrongTenant.Code != 403 {
		t.Errorf("403 bodies differ: wrong tenant %s, wrong role %s", wrongTenant.Body, wrongRole.Body)
	}
	if m := decodeMap(t, wrongTenant); m["message"] != "authorization: this token does not allow this request" {
		t.Errorf("403 body = %s", wrongTenant.Body)
	}
}

// grantsPolicy puts acme on the default plan, free, and grants it pro.
const grantsPolicy = `
default_plan: free
plans: {free: {}, pro: {}, enterprise: {}}
tenants:
  acme: {plans: [pro]}
`

// TestPlanGrants: a token bound to a tenant may name only the plans the
// policy grants the tenant (its own plan and tenants.<t>.plans), on admit,
// authz and the usage query; anything else is 403 before the decider is
// called. Unbound tokens and admins may name any plan.
func TestPlanGrants(t *testing.T) {
	pol, err := policy.Parse([]byte(grantsPolicy))
	if err != nil {
		t.Fatal(err)
	}
	e := newEnv(t, func(o *Options) {
		o.Policy = func() *policy.Policy { return pol }
		withAuth(t, auth.Options{Tokens: []string{"s3cret-acme@acme", "s3cret-any", "s3cret-admin#admin"}})(o)
	}).answering()
	var usagePlans []string
	e.dec.usage = func(_, _, plan string) ([]decide.LimitState, error) {
		usagePlans = append(usagePlans, plan)
		return nil, nil
	}
	calls := map[string]func(plan, tok string) int{
		"admit": func(plan, tok string) int {
			return e.do("POST", "/v1/admit", `{"tenant":"acme","user":"u","endpoint":"/e","plan":"`+plan+`"}`, bearer(tok)...).Code
		},
		"authz": func(plan, tok string) int {
			return e.do("GET", "/v1/authz/e", "", append(bearer(tok), hdrTenant, "acme", hdrUser, "u", hdrPlan, plan)...).Code
		},
		"usage query": func(plan, tok string) int {
			return e.do("GET", "/v1/usage?tenant=acme&user=u&plan="+plan, "", bearer(tok)...).Code
		},
	}
	for name, call := range calls {
		for _, tc := range []struct {
			token, plan string
			want        int
		}{
			{"s3cret-acme", "", 200},            // the tenant's own plan
			{"s3cret-acme", "free", 200},        // named: its own plan (default_plan)
			{"s3cret-acme", "pro", 200},         // granted by tenants.acme.plans
			{"s3cret-acme", "enterprise", 403},  // not granted
			{"s3cret-acme", "gold", 403},        // not a plan at all: not granted either
			{"s3cret-any", "enterprise", 200},   // not bound: any plan
			{"s3cret-admin", "enterprise", 200}, // admin: any plan
		} {
			admits, usages := e.dec.calls(), len(usagePlans)
			if code := call(tc.plan, tc.token); code != tc.want {
				t.Errorf("%s with plan %q by %s = %d, want %d", name, tc.plan, tc.token, code, tc.want)
			}
			if tc.want == 403 && (e.dec.calls() != admits || len(usagePlans) != usages) {
				t.Errorf("%s with plan %q by %s reached the decider before its 403", name, tc.plan, tc.token)
			}
		}
	}
	// The plan reaches the decider as named.
	if got := e.dec.lastInput(t).Plan; got != "enterprise" {
		t.Errorf("the decider got plan %q, want enterprise", got)
	}
}

// save writes content to path through a rename, as editors and the
// kubelet do, so the watcher never reads it half-written.
func save(t *testing.T, path, content string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// TestTokensFileRotation: QF_API_TOKENS_FILE's tokens, given by their
// SHA-256, rotate without a restart: after the reload the old token gets
// 401 and the new one works; an invalid edit keeps the last good tokens;
// QF_API_TOKENS's stay in force throughout.
func TestTokensFileRotation(t *testing.T) {
	path := filepath.Join(t.TempDir(), "tokens.yaml")
	save(t, path, "- {sha256: "+authtest.SHA256Hex("s3cret-v1")+", tenant: acme}\n")
	verdicts := make(chan error, 10)
	var a *auth.Auth
	e := newEnv(t, func(o *Options) {
		withAuth(t, auth.Options{Tokens: []string{"s3cret-env#gateway"}, File: path, Debounce: 10 * time.Millisecond,
			OnReload: func(err error) { verdicts <- err }})(o)
		a = o.Auth
	})
	e.dec.admit = allowed
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { a.Watch(ctx); close(done) }()
	defer func() { cancel(); <-done }()

	admit := func(tok string) int {
		return e.do("POST", "/v1/admit", `{"tenant":"acme","user":"u","endpoint":"/e"}`, bearer(tok)...).Code
	}
	reloaded := func() error {
		t.Helper()
		select {
		case err := <-verdicts:
			return err
		case <-time.After(10 * time.Second):
			t.Fatal("no reload within 10s of the change")
			return nil
		}
	}
	if v1, env := admit("s3cret-v1"), admit("s3cret-env"); v1 != 200 || env != 200 {
		t.Fatalf("before rotating: v1 %d, env %d; want 200, 200", v1, env)
	}

	save(t, path, "- {sha256: "+authtest.SHA256Hex("s3cret-v2")+", tenant: acme}\n")
	if err := reloaded(); err != nil {
		t.Fatalf("reload of the rotated file = %v", err)
	}
	if v1, v2, env := admit("s3cret-v1"), admit("s3cret-v2"), admit("s3cret-env"); v1 != 401 || v2 != 200 || env != 200 {
		t.Errorf("after rotating: v1 %d, v2 %d, env %d; want 401, 200, 200", v1, v2, env)
	}

	save(t, path, "- {sha256: "+authtest.SHA256Hex("s3cret-v3")[:40]+", tenant: acme}\n- {token: s3cret-v4, roles: [everything]}\n")
	err := reloaded()
	if err == nil || !strings.Contains(err.Error(), "[0].sha256: want the 64 hex digits") || !strings.Contains(err.Error(), "[1].roles[0]: unknown role") {
		t.Fatalf("reload of an invalid file = %v, want both mistakes by path", err)
	}
	authtest.NoSecrets(t, "the reload error", err.Error(), "s3cret-v3", "s3cret-v4")
	if v2, v4 := admit("s3cret-v2"), admit("s3cret-v4"); v2 != 200 || v4 != 401 {
		t.Errorf("after an invalid edit: v2 %d, v4 %d; want 200 (the last good tokens), 401", v2, v4)
	}
	cancel()
	<-done
	authtest.NoSecrets(t, "the logs", e.logs.String(), "s3cret-v1", "s3cret-v2", "s3cret-v3", "s3cret-v4", "s3cret-env")
	if !strings.Contains(e.logs.String(), "tokens file rejected") {
		t.Errorf("the rejected edit is not logged: %s", e.logs.String())
	}
}
