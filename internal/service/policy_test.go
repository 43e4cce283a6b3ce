package service

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"quotaflow/internal/e2e"
	"quotaflow/pkg/limits/policy"
)

const (
	goodV1 = "default_plan: free\nplans: {free: {}, pro: {}}\n"
	goodV2 = "default_plan: pro\nplans: {free: {}, pro: {}}\n"
	goodV3 = "default_plan: free\nplans: {free: {}, pro: {}}\nshadow: true\n"
	broken = "default_plan: free\nplans: {free: {quotas: [{name: a, kind: fixed, window: 0, limit: 1}]}}\n"
)

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

// replaceFile saves content the way many editors do: write a temporary file,
// then rename it over the old one.
func replaceFile(t *testing.T, path, content string) {
	t.Helper()
	tmp := path + ".tmp"
	writeFile(t, tmp, content)
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// reloads records what a PolicyWatcher's hook saw.
type reloads struct {
	mu    sync.Mutex
	calls []error // nil for a success
	ch    chan error
}

func newReloads() *reloads { return &reloads{ch: make(chan error, 100)} }

func (r *reloads) hook(p *policy.Policy, err error) {
	r.mu.Lock()
	r.calls = append(r.calls, err)
	r.mu.Unlock()
	r.ch <- err
}

func (r *reloads) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.calls)
}

// next waits for the hook's next call.
func (r *reloads) next(t *testing.T) error {
	t.Helper()
	select {
	case err := <-r.ch:
		return err
	case <-time.After(10 * time.Second):
		t.Fatal("no reload within 10s")
		return nil
	}
}

// runWatcher runs w until the test ends and checks that Run returns nil.
func runWatcher(t *testing.T, w *PolicyWatcher) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run() = %v, want nil after cancel", err)
		}
	})
}

func TestReloadKeepsLastGoodPolicy(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "policy.yaml")
	writeFile(t, path, goodV1)
	rec := newReloads()
	w, err := NewPolicyWatcher(path, nil, WithPolicyReloadHook(rec.hook))
	if err != nil {
		t.Fatalf("NewPolicyWatcher() error = %v", err)
	}
	first := w.Current()

	if err := w.Reload(); err != nil || w.Current() != first || rec.count() != 0 {
		t.Fatalf("Reload() of an unchanged file = %v, swapped %v, hook calls %d; want nil, false, 0",
			err, w.Current() != first, rec.count())
	}

	writeFile(t, path, broken)
	err = w.Reload()
	want := "load policy " + path + ": plans.free.quotas[0].window: must be positive"
	if err == nil || err.Error() != want {
		t.Fatalf("Reload() of a broken file = %v, want %s", err, want)
	}
	if w.Current() != first {
		t.Fatal("Reload() of a broken file replaced the policy")
	}
	if got := rec.next(t); got == nil || got.Error() != want {
		t.Errorf("hook error = %v, want %s", got, want)
	}
	// The same broken content again: the same error, no second hook call.
	if err2 := w.Reload(); err2 == nil || err2.Error() != want || rec.count() != 1 {
		t.Errorf("second Reload() of the same broken file = %v with %d hook calls, want the same error and 1 call", err2, rec.count())
	}

	replaceFile(t, path, goodV2)
	if err := w.Reload(); err != nil {
		t.Fatalf("Reload() of a good edit = %v", err)
	}
	if got := w.Current().DefaultPlan; got != "pro" {
		t.Errorf("after a good edit DefaultPlan = %q, want pro", got)
	}
	if err := rec.next(t); err != nil {
		t.Errorf("hook error after a good edit = %v, want nil", err)
	}

	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if err := w.Reload(); !errors.Is(err, os.ErrNotExist) || w.Current().DefaultPlan != "pro" {
		t.Errorf("Reload() of a missing file = %v, plan %q; want os.ErrNotExist and pro still in force", err, w.Current().DefaultPlan)
	}
}

func TestReloadOnFileChange(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "policy.yaml")
	writeFile(t, path, goodV1)
	rec := newReloads()
	var logs e2e.Buffer
	log := slog.New(slog.NewJSONHandler(&logs, nil))
	w, err := NewPolicyWatcher(path, log, WithPolicyReloadHook(rec.hook), WithPolicyReloadDebounce(20*time.Millisecond))
	if err != nil {
		t.Fatalf("NewPolicyWatcher() error = %v", err)
	}
	runWatcher(t, w)

	// Written in place, broken: the last good policy stays, the error is
	// reported and logged.
	writeFile(t, path, broken)
	for {
		// A reload may catch the file truncated but not yet written
		// ("policy is empty"); the write's own event follows.
		err := rec.next(t)
		if err == nil {
			t.Fatal("hook reported success for a broken file")
		}
		if strings.Contains(err.Error(), "plans.free.quotas[0].window: must be positive") {
			break
		}
	}
	if got := w.Current().DefaultPlan; got != "free" {
		t.Errorf("after a broken edit DefaultPlan = %q, want free (the last good policy)", got)
	}
	e2e.Eventually(t, "the failure in the log", func() bool {
		return strings.Contains(logs.String(), `"msg":"policy rejected; the last good one stays in force"`)
	})

	// Saved by rename, good: picked up.
	replaceFile(t, path, goodV2)
	e2e.Eventually(t, "default_plan pro", func() bool { return w.Current().DefaultPlan == "pro" })

	// Written in place, good.
	writeFile(t, path, goodV3)
	e2e.Eventually(t, "shadow policy", func() bool { return w.Current().Shadow })
}

func TestReloadConfigMapSymlinkSwap(t *testing.T) {
	// A ConfigMap volume: policy.yaml -> ..data/policy.yaml, ..data -> ..v1;
	// the kubelet writes ..v2, points ..data_tmp at it and renames it over
	// ..data.
	dir := t.TempDir()
	mkVersion := func(name, content string) {
		if err := os.Mkdir(filepath.Join(dir, name), 0o755); err != nil {
			t.Fatal(err)
		}
		writeFile(t, filepath.Join(dir, name, "policy.yaml"), content)
	}
	mkVersion("..v1", goodV1)
	if err := os.Symlink("..v1", filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "policy.yaml")
	if err := os.Symlink(filepath.Join("..data", "policy.yaml"), path); err != nil {
		t.Fatal(err)
	}
	w, err := NewPolicyWatcher(path, nil, WithPolicyReloadDebounce(20*time.Millisecond))
	if err != nil {
		t.Fatalf("NewPolicyWatcher() error = %v", err)
	}
	runWatcher(t, w)

	mkVersion("..v2", goodV2)
	if err := os.Symlink("..v2", filepath.Join(dir, "..data_tmp")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(dir, "..data_tmp"), filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(filepath.Join(dir, "..v1")); err != nil {
		t.Fatal(err)
	}
	e2e.Eventually(t, "default_plan pro after the swap", func() bool { return w.Current().DefaultPlan == "pro" })
}

func TestReloadNewWatcherRejectsBadFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "policy.yaml")
	writeFile(t, path, broken)
	if _, err := NewPolicyWatcher(path, nil); err == nil || !strings.Contains(err.Error(), "plans.free.quotas[0].window: must be positive") {
		t.Errorf("NewPolicyWatcher(broken) error = %v, want the window error", err)
	}
	if _, err := NewPolicyWatcher(filepath.Join(dir, "missing.yaml"), nil); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("NewPolicyWatcher(missing) error = %v, want os.ErrNotExist", err)
	}
}

func TestReloadRunStopsWithContext(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "policy.yaml")
	writeFile(t, path, goodV1)
	w, err := NewPolicyWatcher(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run() = %v, want nil", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run() did not return after cancel")
	}
}
