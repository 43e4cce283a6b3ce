package rlsconf

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A directory's edits reach Current; a broken one is rejected once, however
// often it is reloaded (the reload counter counts new content), and the last
// good configuration stays in force; a file missing for a moment is no
// verdict on any content.
func TestWatcherReload(t *testing.T) {
	dir := t.TempDir()
	write := func(name, s string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, name), []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("a.yaml", "domain: a\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 3}\n")
	var hooks []error
	w, err := NewWatcher(dir, nil, func(err error) { hooks = append(hooks, err) })
	if err != nil {
		t.Fatal(err)
	}
	first := w.Current()
	if first.Domains() != 1 || w.Reload() != nil || w.Current() != first || len(hooks) != 0 {
		t.Fatalf("unchanged reload: %d domains, swapped %v, hooks %v; want 1 domain kept, no hook", first.Domains(), w.Current() != first, hooks)
	}

	write("b.yaml", "domain: b\ndescriptors:\n  - key: k\n    bogus: 1\n")
	for i := range 3 {
		if err := w.Reload(); err == nil || !strings.Contains(err.Error(), "b.yaml") {
			t.Errorf("reload %d of a broken file = %v, want its error naming b.yaml", i, err)
		}
	}
	if len(hooks) != 1 || hooks[0] == nil || w.Current() != first {
		t.Fatalf("after 3 reloads of one broken edit: hooks %v, swapped %v; want one rejection, the last good one in force", hooks, w.Current() != first)
	}

	write("b.yaml", "domain: b\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1}\n")
	if err := w.Reload(); err != nil || !w.Current().HasDomain("b") || len(hooks) != 2 || hooks[1] != nil {
		t.Fatalf("good edit: %v, domain b %v, hooks %v; want in force and reported", err, w.Current().HasDomain("b"), hooks)
	}

	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	if err := w.Reload(); err == nil || !w.Current().HasDomain("b") || len(hooks) != 2 {
		t.Errorf("missing directory: %v, hooks %v; want an error, the last good one, no hook", err, hooks)
	}
}
