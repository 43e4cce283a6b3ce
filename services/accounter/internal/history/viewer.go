package history

import (
	"errors"
	"net/http"
	"strings"
	"unicode/utf8"

	"quotaflow/internal/auth"
	"quotaflow/pkg/ident"
)

// CookieName is the cookie that carries a browser's token: the console's
// sign-in sets it, Authenticate reads it.
const CookieName = "qf_console_token"

// ErrForbidden is Viewer.Tenant's answer for a tenant the viewer may not
// read.
var ErrForbidden = errors.New("this token may not read that tenant")

// Viewer is who asks: what an authenticated request's token may read.
type Viewer struct {
	p auth.Principal
}

// Authenticate returns the viewer of r's token, from its Authorization
// header or else from its CookieName cookie; ok is false without a known
// token (401). A nil a is no authentication: the viewer reads everything
// (the console then listens on loopback only).
func Authenticate(a *auth.Auth, r *http.Request) (v Viewer, ok bool) {
	var p auth.Principal
	if h := r.Header.Get("Authorization"); h != "" {
		p, ok = a.AuthenticateHeader(h)
	} else if c, err := r.Cookie(CookieName); err == nil {
		p, ok = a.AuthenticateToken(c.Value)
	} else {
		p, ok = a.AuthenticateHeader("")
	}
	return Viewer{p: p}, ok
}

// Authorization returns what authenticated r, as an Authorization header's
// value: its own header, else its CookieName cookie's token as a bearer
// token; empty without either. The alerter's API is called with it, so the
// viewer reads its alerts with its own token.
func Authorization(r *http.Request) string {
	if h := r.Header.Get("Authorization"); h != "" {
		return h
	}
	if c, err := r.Cookie(CookieName); err == nil && c.Value != "" {
		return "Bearer " + c.Value
	}
	return ""
}

// ViewerOf returns the viewer of a principal already authenticated (the
// console's signed-in cookie).
func ViewerOf(p auth.Principal) Viewer { return Viewer{p: p} }

// ReadsAll reports whether v reads every tenant (an admin).
func (v Viewer) ReadsAll() bool { return v.p.ReadsAll() }

// Tenants lists the tenants v's token is bound to: what a viewer that does
// not read all may read.
func (v Viewer) Tenants() []string { return v.p.Tenants() }

// Tenant returns tenant as one v may read: an error naming the problem for
// an identifier admission would refuse (*ParamError), ErrForbidden for a
// tenant v may not read. This is the one check of tenant scoping.
func (v Viewer) Tenant(tenant string) (Tenant, error) {
	if err := checkID("tenant", tenant, true); err != nil {
		return Tenant{}, err
	}
	if !v.p.Reads(tenant) {
		return Tenant{}, ErrForbidden
	}
	return Tenant{name: tenant, p: v.p}, nil
}

// Tenant is a tenant its viewer may read; make one with Viewer.Tenant.
type Tenant struct {
	name string
	p    auth.Principal // the viewer: which plans it may read (auth.Principal.NamesPlan)
}

// Name is the tenant's identifier.
func (t Tenant) Name() string { return t.name }

// ParamError is a bad query parameter: Param names it, Problem says what
// is wrong. Handlers answer it with 400.
type ParamError struct {
	Param, Problem string
}

func (e *ParamError) Error() string { return e.Param + ": " + e.Problem }

// checkID validates an identifier as admission does (package ident),
// non-empty when required.
func checkID(param, v string, required bool) error {
	if v == "" {
		if required {
			return &ParamError{param, "required"}
		}
		return nil
	}
	if err := ident.Check(v); err != nil {
		return &ParamError{param, err.Error()}
	}
	return nil
}

// maxCursor bounds an after of the subject lists: a user id as the ledger
// holds it, which checkID may refuse (a rule changed since it was written),
// so that paging can still pass it.
const maxCursor = 4096

// checkCursor checks an after of the subject lists as checkID would,
// but up to maxCursor bytes.
func checkCursor(v string) error {
	if len(v) > maxCursor || !utf8.ValidString(v) || strings.ContainsFunc(v, ident.IsControl) {
		return &ParamError{"after", "want a user a page's next named"}
	}
	return nil
}
