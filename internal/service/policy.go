package service

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"quotaflow/internal/filewatch"
	"quotaflow/pkg/limits/policy"
)

// PolicyWatcher keeps the current policy of a file that operators may edit
// while the service runs. Current is what request handlers call: one atomic
// load.
// Reload re-reads the file (call it on SIGHUP); Run reloads whenever the
// file changes. A file that fails to load or validate leaves the last good
// policy in force, and the failure comes back from Reload and reaches the
// logger and the OnReload hook with its precise error.
//
// Run watches the file's directory rather than the file, so that it sees
// editors that save by renaming a new file over the old one and Kubernetes
// ConfigMap volumes, whose files are symlinks through a "..data" symlink
// that the kubelet swaps. A policy path that is itself a symlink into
// another directory is only seen to change through SIGHUP.
//
// Create one with NewPolicyWatcher (the zero PolicyWatcher is not usable);
// its methods are safe for concurrent use.
type PolicyWatcher struct {
	path     string
	log      *slog.Logger
	onReload func(*policy.Policy, error)
	debounce time.Duration

	cur atomic.Pointer[policy.Policy]

	mu      sync.Mutex // serializes reloads; guards the fields below
	lastSum string     // digest of the last content tried, good or bad
	lastErr error      // its error, nil when it loaded
}

// PolicyWatcherOption configures a PolicyWatcher.
type PolicyWatcherOption func(*PolicyWatcher)

// WithPolicyReloadHook sets a function called after every reload that found
// new content in the file: with the new policy and a nil error when it is
// now in force, with nil and the error when it was rejected. A reload that
// finds the content it already tried does not call it. Use it for metrics (a
// reload counter, a "last reload succeeded" gauge). It runs on the
// reloading goroutine, under the watcher's reload lock: keep it short and do
// not call Reload from it.
func WithPolicyReloadHook(f func(p *policy.Policy, err error)) PolicyWatcherOption {
	return func(w *PolicyWatcher) { w.onReload = f }
}

// WithPolicyReloadDebounce sets how long Run waits after the last change to
// the directory before it reloads, so that a burst of events from one save (an
// editor's write, rename and chmod; the kubelet's symlink swap) costs one
// reload of the finished file. The default is 100 ms; d ≤ 0 keeps it.
func WithPolicyReloadDebounce(d time.Duration) PolicyWatcherOption {
	return func(w *PolicyWatcher) {
		if d > 0 {
			w.debounce = d
		}
	}
}

// NewPolicyWatcher loads the policy file at path and returns a watcher
// holding it. It fails if the file does not load: a service should not start without a
// valid policy. log receives reload results under component=policy; nil
// discards them.
func NewPolicyWatcher(path string, log *slog.Logger, opts ...PolicyWatcherOption) (*PolicyWatcher, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, fmt.Errorf("policy path %s: %w", path, err)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	w := &PolicyWatcher{
		path:     abs,
		log:      log.With("component", "policy", "path", abs),
		debounce: 100 * time.Millisecond,
	}
	for _, o := range opts {
		o(w)
	}
	p, err := policy.LoadFile(abs)
	if err != nil {
		return nil, err
	}
	w.cur.Store(p)
	w.lastSum = p.Digest()
	return w, nil
}

// Current returns the policy in force. It never returns nil and never
// blocks; hold the result for the whole of one request so that a reload in
// between does not mix two policies.
func (w *PolicyWatcher) Current() *policy.Policy { return w.cur.Load() }

// Reload re-reads the file and, if it loads, puts it in force and logs the
// change. If it does not, the current policy stays and Reload returns the
// error (it does not log it: the caller decides). Content identical to the
// last content tried is not parsed again: Reload then returns that
// attempt's result, so a SIGHUP on a file that is still broken reports the
// same error.
func (w *PolicyWatcher) Reload() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	data, err := policy.ReadFile(w.path)
	if err != nil {
		// Not a verdict on any content (the file may be missing for a moment
		// mid-rename): the next read is judged afresh.
		w.lastSum, w.lastErr = "", nil
		return err
	}
	sum := policy.DigestOf(data)
	if sum == w.lastSum {
		return w.lastErr
	}
	p, err := policy.Parse(data)
	if err != nil {
		err = fmt.Errorf("load policy %s: %w", w.path, err)
	}
	w.lastSum, w.lastErr = sum, err
	if err != nil {
		w.hook(nil, err)
		return err
	}
	old := w.cur.Swap(p)
	w.log.Info("policy reloaded", "digest", p.Digest(), "previous_digest", old.Digest(),
		"plans", len(p.Plans), "tenants", len(p.Tenants), "endpoints", len(p.Endpoints))
	w.hook(p, nil)
	return nil
}

func (w *PolicyWatcher) hook(p *policy.Policy, err error) {
	if w.onReload != nil {
		w.onReload(p, err)
	}
}

// Run watches the policy file's directory and reloads the file after each
// change (see PolicyWatcher), logging failures at Error; it also reloads
// once when the watch is in place, to catch a change made before. It returns nil when
// ctx is done, or an error if the directory cannot be watched. Call it once,
// on a goroutine its owner waits for.
func (w *PolicyWatcher) Run(ctx context.Context) error {
	return filewatch.Run(ctx, w.path, w.debounce, w.log, "policy", w.reloadAndLog)
}

func (w *PolicyWatcher) reloadAndLog() {
	if err := w.Reload(); err != nil {
		w.log.Error("policy reload failed; the last good policy stays in force",
			"err", err, "digest", w.Current().Digest())
	}
}

// WatchPolicy loads the policy file at path (NewPolicyWatcher) and keeps
// it current until the stack stops it: it reloads on a change of the file
// and on SIGHUP, and logs an edit it rejected (the last good policy stays
// in force).
func WatchPolicy(s *Stack, path string, log *slog.Logger, opts ...PolicyWatcherOption) (*PolicyWatcher, error) {
	w, err := NewPolicyWatcher(path, log, opts...)
	if err != nil {
		return nil, err
	}
	s.Go("policy file", func(ctx context.Context) {
		filewatch.OnSIGHUP(ctx, log, "policy file", w.Run, func() {
			if err := w.Reload(); err != nil {
				log.Error("policy reload on SIGHUP rejected; the last good policy stays in force", "err", err)
			}
		})
	})
	return w, nil
}
