package console

import (
	"context"
	"net/http"
	"net/url"
	"strings"

	"quotaflow/internal/auth"
	"quotaflow/pkg/ident"
)

// maxTokenLen bounds a posted token; no configured token is longer.
const maxTokenLen = 4096

// signinForm shows the sign-in form.
func (h *Handler) signinForm(w http.ResponseWriter, r *http.Request) {
	h.render(w, r, http.StatusOK, "signin", page{Title: "Sign in"})
}

// signin checks the posted token and, when some entry holds it, keeps it
// in the cookie and goes to the first page. A refused token is told apart
// from nothing else: the form says only that it was not accepted.
func (h *Handler) signin(w http.ResponseWriter, r *http.Request) {
	if !sameOrigin(r) {
		http.Error(w, "cross-site sign-in refused", http.StatusForbidden)
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, maxTokenLen+64)
	tok := strings.TrimSpace(r.PostFormValue("token"))
	if tok == "" || len(tok) > maxTokenLen {
		h.render(w, r, http.StatusBadRequest, "signin", page{Title: "Sign in", Error: "Enter a token."})
		return
	}
	if _, ok := h.principal(tok); !ok {
		h.render(w, r, http.StatusUnauthorized, "signin", page{Title: "Sign in", Error: "That token was not accepted."})
		return
	}
	http.SetCookie(w, &http.Cookie{
		Name: CookieName, Value: tok, Path: "/",
		HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: overTLS(r),
	})
	http.Redirect(w, r, "/", http.StatusSeeOther)
}

// signout clears the cookie.
func (h *Handler) signout(w http.ResponseWriter, r *http.Request) {
	if !sameOrigin(r) {
		http.Error(w, "cross-site sign-out refused", http.StatusForbidden)
		return
	}
	http.SetCookie(w, &http.Cookie{
		Name: CookieName, Value: "", Path: "/", MaxAge: -1,
		HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: overTLS(r),
	})
	http.Redirect(w, r, "/signin", http.StatusSeeOther)
}

// overTLS reports whether the browser reached the console over https: the
// accounter serves plain HTTP, so that is TLS ended by a proxy in front of
// it, which says so in X-Forwarded-Proto or Forwarded. The cookie holds
// the token itself and must then never go out over plain HTTP. Believing a
// client that claims https costs nothing: its browser then keeps the
// cookie from plain HTTP, its own sign-in included.
func overTLS(r *http.Request) bool {
	if r.TLS != nil {
		return true
	}
	if strings.EqualFold(firstHop(r.Header.Get("X-Forwarded-Proto")), "https") {
		return true
	}
	for _, p := range strings.Split(firstHop(r.Header.Get("Forwarded")), ";") {
		if k, v, ok := strings.Cut(strings.TrimSpace(p), "="); ok && strings.EqualFold(k, "proto") && strings.EqualFold(strings.Trim(v, `"`), "https") {
			return true
		}
	}
	return false
}

// firstHop is a forwarding header's first element: the hop next to the
// browser, as the proxy nearest to it wrote it.
func firstHop(v string) string {
	v, _, _ = strings.Cut(v, ",")
	return strings.TrimSpace(v)
}

// sameOrigin reports whether a form post came from the console's own
// pages. SameSite=Strict keeps the cookie off other sites' posts, but not
// a post that signs a victim in with the attacker's token; browsers send
// Sec-Fetch-Site or Origin with every post.
func sameOrigin(r *http.Request) bool {
	if s := r.Header.Get("Sec-Fetch-Site"); s != "" {
		return s == "same-origin"
	}
	o := r.Header.Get("Origin")
	if o == "" {
		return true // not a browser: no cookie of a victim to ride
	}
	u, err := url.Parse(o)
	return err == nil && u.Host == r.Host
}

// principal returns what tok may do; ok is false for a token no entry
// holds and for one that reads no tenant.
func (h *Handler) principal(tok string) (auth.Principal, bool) {
	p, ok := h.auth.AuthenticateToken(tok)
	return p, ok && (p.ReadsAll() || len(p.Tenants()) > 0)
}

// signedInAs returns what the request's cookie may do.
func (h *Handler) signedInAs(r *http.Request) (auth.Principal, bool) {
	c, err := r.Cookie(CookieName)
	if err != nil || c.Value == "" || len(c.Value) > maxTokenLen {
		return auth.Principal{}, false
	}
	return h.principal(c.Value)
}

// signedIn runs next for a request whose cookie holds an accepted token
// and sends any other to the sign-in form.
func (h *Handler) signedIn(next func(http.ResponseWriter, *http.Request, auth.Principal)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		p, ok := h.signedInAs(r)
		if !ok {
			http.Redirect(w, r, "/signin", http.StatusSeeOther)
			return
		}
		c, _ := r.Cookie(CookieName) // signedInAs found it
		ctx := context.WithValue(r.Context(), principalKey{}, p)
		ctx = context.WithValue(ctx, authorizationKey{}, "Bearer "+c.Value)
		next(w, r.WithContext(ctx), p)
	}
}

// tenantPage runs next for the URL's tenant when the cookie's token may
// see it. A tenant it may not see is not found, as one that does not
// exist, so a token learns nothing of other tenants.
func (h *Handler) tenantPage(next func(http.ResponseWriter, *http.Request, page)) http.HandlerFunc {
	return h.signedIn(func(w http.ResponseWriter, r *http.Request, p auth.Principal) {
		t := tenantOf(r.PathValue("tenant"))
		if t == "" || ident.Check(t) != nil || !p.Reads(t) {
			h.render(w, r, http.StatusNotFound, "error", page{Title: "Not found", SignedIn: true,
				Error: "No such tenant, or not one this token may see."})
			return
		}
		next(w, r, page{Title: t, Tenant: t, SignedIn: true})
	})
}
