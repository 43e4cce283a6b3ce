// Package browser runs Debian's chromium headless for tests, through
// chromedp, and records every request its pages make, so a test can check
// that a page reached no host but the loopback.
//
// deploy/deps.sh installs chromium (browser downloads are unreachable in
// CI). Without it a test skips, except under CI=true, where it fails.
package browser

import (
	"context"
	"net"
	"net/url"
	"os"
	"os/exec"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/emulation"
	cdplog "github.com/chromedp/cdproto/log"
	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"
)

// timeout bounds everything a test does in the browser.
const timeout = 4 * time.Minute

// Browser is one headless chromium with a fresh profile.
type Browser struct {
	// Ctx runs chromedp actions in the browser's first tab.
	Ctx context.Context

	mu     sync.Mutex
	urls   []string
	errors []string
}

// Start launches chromium for the test and stops it at its end.
func Start(t testing.TB) *Browser {
	t.Helper()
	path, err := exec.LookPath("chromium")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("chromium not found (deploy/deps.sh installs it): %v", err)
		}
		t.Skipf("chromium not found (run `go tool task deps`): %v", err)
	}
	opts := []chromedp.ExecAllocatorOption{
		chromedp.ExecPath(path),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.Headless,
		// As root (CI containers), chromium refuses to start sandboxed.
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck,
		// Nothing of chromium's own may reach the network either.
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-default-apps", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.WindowSize(1280, 900),
	}
	// A hung page fails the test in minutes rather than at go test's
	// timeout, with the step that hung.
	tctx, cancelTime := context.WithTimeout(context.Background(), timeout)
	actx, cancelAlloc := chromedp.NewExecAllocator(tctx, opts...)
	b := &Browser{}
	ctx, cancel := chromedp.NewContext(actx, chromedp.WithListener(func(ev any) {
		b.mu.Lock()
		defer b.mu.Unlock()
		switch e := ev.(type) {
		case *network.EventRequestWillBeSent:
			b.urls = append(b.urls, e.Request.URL)
		case *cdplog.EventEntryAdded: // CSP violations land here
			if e.Entry.Level == cdplog.EntryLevelError {
				b.errors = append(b.errors, e.Entry.Text)
			}
		case *runtime.EventExceptionThrown:
			d := e.ExceptionDetails
			if d.Exception != nil && d.Exception.Description != "" {
				b.errors = append(b.errors, d.Exception.Description)
			} else {
				b.errors = append(b.errors, d.Text)
			}
		}
	}))
	b.Ctx = ctx
	_, err = chromedp.Call(ctx, network.Enable, network.EnableParams{})
	if err == nil {
		_, err = chromedp.Call(ctx, cdplog.Enable, cdp.Empty{})
	}
	if err == nil { // a headless page has no focus of its own, so no keyboard
		_, err = chromedp.Call(ctx, emulation.SetFocusEmulationEnabled, emulation.SetFocusEmulationEnabledParams{Enabled: true})
	}
	if err != nil {
		cancel()
		cancelAlloc()
		cancelTime()
		t.Fatalf("start chromium: %v", err)
	}
	t.Cleanup(func() {
		cancel()
		cancelAlloc()
		cancelTime()
	})
	return b
}

// Requests returns the URL of every request the pages made so far.
func (b *Browser) Requests() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.urls...)
}

// Errors returns what the pages logged as errors so far: uncaught
// exceptions and the browser's own, such as a Content-Security-Policy
// violation or a failed load.
func (b *Browser) Errors() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.errors...)
}

// Foreign returns the requests to anywhere but a loopback address; data:
// URLs stay in the page.
func (b *Browser) Foreign() []string {
	var out []string
	for _, s := range b.Requests() {
		u, err := url.Parse(s)
		if err == nil && u.Scheme == "data" {
			continue
		}
		if err != nil || !loopback(u.Hostname()) {
			out = append(out, s)
		}
	}
	return out
}

func loopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
