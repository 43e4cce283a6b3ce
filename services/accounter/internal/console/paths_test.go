package console

import (
	"context"
	"html"
	"io"
	"log/slog"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"testing"

	"quotaflow/internal/auth"
)

// oddTenants are ids admission accepts (ident.Check) that hold URL
// delimiters, are dot segments, or start with tenantSegment's "~".
var oddTenants = []string{"acme/usage", "b?x", "c#d", "e%2Fz", ".", "..", "~..", "~f", `q"<x>`}

type oddLedger struct{ ledger }

func (oddLedger) Tenants(context.Context, string) (Tenants, error) {
	return Tenants{Tenants: oddTenants}, nil
}

var (
	tenantLink = regexp.MustCompile(`<li><a href="([^"]*)">([^<]*)</a>`)
	navLink    = regexp.MustCompile(`<li><a href="([^"]*)"`)
)

// TestTenantLinks checks that every link the console draws to a tenant,
// resolved as a browser does (dot segments removed), reaches that
// tenant's page: the admin's list of tenants, the landing of a token
// bound to one, and its six tabs.
func TestTenantLinks(t *testing.T) {
	toks := []string{"admin-tok#admin"}
	for i, tn := range oddTenants {
		if !strings.Contains(tn, "#") { // a token's roles follow '#'
			toks = append(toks, "tok"+string(rune('0'+i))+"@"+tn)
		}
	}
	a, err := auth.New(auth.Options{Tokens: toks})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(New(Options{Auth: a, Source: &oddLedger{}, Log: slog.New(slog.NewTextHandler(io.Discard, nil))}))
	defer srv.Close()
	base, _ := url.Parse(srv.URL + "/")

	// reaches GETs href as tok and checks it is tenant's page.
	reaches := func(href, tok, tenant string) string {
		t.Helper()
		ref, err := url.Parse(html.UnescapeString(href))
		if err != nil {
			t.Fatalf("link %q: %v", href, err)
		}
		path := base.ResolveReference(ref).RequestURI()
		resp, body := get(t, srv, path, tok)
		if want := "<title>" + html.EscapeString(tenant) + " · "; resp.StatusCode != 200 || !strings.Contains(body, want) {
			t.Errorf("link %q of tenant %q goes to %s = %d, want 200 and its page (%s)", href, tenant, path, resp.StatusCode, want)
		}
		return body
	}

	_, body := get(t, srv, "/", "admin-tok")
	links := tenantLink.FindAllStringSubmatch(body, -1)
	if len(links) != len(oddTenants) {
		t.Fatalf("the tenants page links %d tenants, want %d:\n%s", len(links), len(oddTenants), body)
	}
	for _, m := range links {
		reaches(m[1], "admin-tok", html.UnescapeString(m[2]))
	}

	for i, tn := range oddTenants {
		if strings.Contains(tn, "#") {
			continue
		}
		tok := "tok" + string(rune('0'+i))
		resp, _ := get(t, srv, "/", tok)
		body := reaches(resp.Header.Get("Location"), tok, tn)
		navs := navLink.FindAllStringSubmatch(body, -1)
		if len(navs) != 6 {
			t.Errorf("tenant %q: %d tabs, want 6", tn, len(navs))
		}
		for _, m := range navs {
			reaches(m[1], tok, tn)
		}
	}
}

// TestTenantSegment checks that a segment gives its tenant back, holds
// no delimiter and is no dot segment.
func TestTenantSegment(t *testing.T) {
	for _, tn := range append(oddTenants, "a", "~", "~~", "a~", "...") {
		seg := tenantSegment(tn)
		un, err := url.PathUnescape(seg)
		if err != nil || tenantOf(un) != tn || strings.ContainsAny(seg, "/?#") || seg == "." || seg == ".." {
			t.Errorf("tenantSegment(%q) = %q, back %q (%v)", tn, seg, tenantOf(un), err)
		}
	}
}
