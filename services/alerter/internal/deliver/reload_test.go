package deliver

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

func TestWatcherReload(t *testing.T) {
	kinds := []string{"quota.threshold", "quota.denial_spike"}
	path := filepath.Join(t.TempDir(), "webhooks.yaml")
	hook := func(name, extra string) string {
		return "  - name: " + name + "\n    url: https://hooks.example.com/" + name + "\n    secret: " + testSecret + "\n" + extra
	}
	write := func(s string) {
		t.Helper()
		if err := os.WriteFile(path, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("webhooks:\n" + hook("a", ""))
	first, err := Load(path, kinds)
	if err != nil {
		t.Fatal(err)
	}
	d, err := New(nil, first, Options{}, slog.New(slog.DiscardHandler), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	w, err := NewWatcher(path, kinds, d.SetWebhooks, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	w.SetDebounce(10 * time.Millisecond)
	route := func() string { return strings.Join(d.Route("quota.threshold", "acme", 80), ",") }

	// SIGHUP path: Reload.
	write("webhooks:\n" + hook("a", "") + hook("b", "    tenants: [acme]\n"))
	if err := w.Reload(); err != nil {
		t.Fatal(err)
	}
	if got := route(); got != "a,b" {
		t.Fatalf("route after reload = %q, want a,b", got)
	}

	// An invalid file: the precise mistake, the last good list kept.
	write("webhooks:\n" + hook("a", "") + hook("b", "    kinds: [quota.nope]\n"))
	err = w.Reload()
	if err == nil || !strings.Contains(err.Error(), "webhooks[1].kinds[0]") || !strings.Contains(err.Error(), path) {
		t.Fatalf("Reload(invalid) = %v, want an error naming %s and webhooks[1].kinds[0]", err, path)
	}
	if got := route(); got != "a,b" {
		t.Fatalf("route after a rejected reload = %q, want a,b", got)
	}
	if names := d.Webhooks(); len(names) != 2 {
		t.Fatalf("webhooks = %v, want the last good two", names)
	}

	// Run: a change of the file is picked up without a Reload call.
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	defer func() { cancel(); <-done }()
	write("webhooks:\n" + hook("c", ""))
	deadline := time.Now().Add(10 * time.Second)
	for route() != "c" {
		if time.Now().After(deadline) {
			t.Fatalf("route = %q, want c after the file changed", route())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if !slices.Equal(d.Route("quota.denial_spike", "", 0), []string{"c"}) {
		t.Errorf("route of a tenantless spike = %v, want c", d.Route("quota.denial_spike", "", 0))
	}
}
