package console

import (
	"fmt"
	"strings"
	"testing"

	"github.com/chromedp/chromedp"
	"github.com/chromedp/chromedp/kb"

	"quotaflow/internal/browser"
)

// TestBrowser drives the pages in chromium: sign-in and navigation by
// keyboard alone, every page drawn without a script error or a policy
// violation, no request to another host, and the tables still there on a
// phone-sized screen. What the pages show of real data is checked against
// the ledger by cmd/demo's TestDemo, on the demo's traffic.
func TestBrowser(t *testing.T) {
	srv, _ := newTestServer(t)
	b := browser.Start(t)
	ctx := b.Ctx

	// Keyboard: the token field has the focus; typing, Tab to the button
	// and Enter sign in.
	if err := chromedp.Do(ctx, chromedp.Navigate(srv.URL+"/signin"), chromedp.WaitVisible("#token")); err != nil {
		t.Fatal(err)
	}
	focused := func() string {
		t.Helper()
		f, err := chromedp.Run(ctx, chromedp.Evaluate[string](`(e => e.id || e.className || e.textContent.trim() || e.tagName)(document.activeElement)`))
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	if f := focused(); f != "token" {
		t.Errorf("focus on /signin is on %q, want the token field", f)
	}
	if err := chromedp.Do(ctx, chromedp.KeyEvent("a-tok\t")); err != nil {
		t.Fatal(err)
	}
	if f := focused(); f != "Sign in" {
		t.Errorf("Tab from the token field reached %q, want the Sign in button", f)
	}
	if err := chromedp.Do(ctx, chromedp.KeyEvent("\r"), chromedp.WaitVisible("#users")); err != nil {
		t.Fatalf("sign in by keyboard: %v", err)
	}
	if err := chromedp.Do(ctx, chromedp.KeyEvent("\t")); err != nil {
		t.Fatal(err)
	}
	if f := focused(); f != "skip" {
		t.Errorf("first Tab on a page reached %q, want the skip link", f)
	}
	// From the users page, tabbing reaches every tenant page's link.
	var links []string
	for range 12 {
		if err := chromedp.Do(ctx, chromedp.KeyEvent("\t")); err != nil {
			t.Fatal(err)
		}
		h, err := chromedp.Run(ctx, chromedp.Evaluate[string](`document.activeElement.getAttribute("href") || ""`))
		if err != nil {
			t.Fatal(err)
		}
		links = append(links, h)
	}
	for _, p := range []string{"/tenants/a", "/tenants/a/near", "/tenants/a/usage", "/tenants/a/top", "/tenants/a/denials", "/tenants/a/alerts"} {
		if !strings.Contains(strings.Join(links, " ")+" ", p+" ") {
			t.Errorf("tabbing from the users page reached %v, not %s", links, p)
		}
	}

	for _, p := range []string{"/tenants/a", "/tenants/a/near", "/tenants/a/usage", "/tenants/a/top", "/tenants/a/denials", "/tenants/a/alerts"} {
		if err := chromedp.Do(ctx, chromedp.Navigate(srv.URL+p), chromedp.WaitVisible("table")); err != nil {
			t.Fatalf("%s: %v", p, err)
		}
	}
	// The windows as drawn: the source's numbers, each in its column.
	if err := chromedp.Do(ctx, chromedp.Navigate(srv.URL+"/tenants/a"), chromedp.WaitVisible("#users")); err != nil {
		t.Fatal(err)
	}
	cells, err := chromedp.Run(ctx, chromedp.Evaluate[[]string](`[...document.querySelectorAll("#tenant-windows td, #users td")].map(td => td.innerText)`))
	if err != nil {
		t.Fatal(err)
	}
	if want := "[900 1000 100 1970-01-03 00:00:00Z user quota 7 10 3 — user requests-per-day-of-v1-chat-completions 1 100 99 1970-01-02 00:00:00Z cannot be read: too long]"; fmt.Sprint(cells) != want {
		t.Errorf("the users page shows %q, want %s", cells, want)
	}
	// The near page's threshold, typed and submitted by keyboard.
	if err := chromedp.Do(ctx, chromedp.Navigate(srv.URL+"/tenants/a/near"), chromedp.WaitVisible("#threshold"), chromedp.Focus("#threshold"),
		chromedp.KeyEvent(kb.End+"\b\b95\r"), chromedp.WaitVisible(`tr[data-user="a-user-near95"]`)); err != nil {
		t.Fatalf("near page by keyboard: %v", err)
	}
	if err := chromedp.Do(ctx, chromedp.Navigate(srv.URL+"/tenants/a/usage"), chromedp.WaitVisible("#chart canvas")); err != nil {
		t.Fatalf("usage chart: %v", err)
	}

	// A phone's width: the table's region fits the screen and scrolls
	// inside it; the page itself does not scroll sideways.
	if err := chromedp.Do(ctx, chromedp.EmulateViewport(360, 740), chromedp.Navigate(srv.URL+"/tenants/a"), chromedp.WaitVisible("#users")); err != nil {
		t.Fatal(err)
	}
	w, err := chromedp.Run(ctx, chromedp.Evaluate[[]int](`[document.documentElement.scrollWidth, document.querySelector(".scroll").getBoundingClientRect().right|0, document.querySelector("#users td.remaining").getBoundingClientRect().width|0]`))
	if err != nil {
		t.Fatal(err)
	}
	if w[0] > 360 || w[1] > 360 || w[2] == 0 {
		t.Errorf("at 360px: page %dpx wide, table region ends at %dpx, remaining cell %dpx wide; want ≤360, ≤360, >0", w[0], w[1], w[2])
	}

	if errs := b.Errors(); len(errs) > 0 {
		t.Errorf("the pages logged errors: %q", errs)
	}
	if f := b.Foreign(); len(f) > 0 {
		t.Errorf("requests left the loopback: %q", f)
	}
}
