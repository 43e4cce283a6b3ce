package limits

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"quotaflow/internal/filewatch"
	"sync"
	"sync/atomic"
	"time"
)

// Watcher keeps the current policy of a file that operators may edit while
// the service runs. Current is what request handlers call: one atomic load.
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
// Create one with NewWatcher (the zero Watcher is not usable); its methods
// are safe for concurrent use.
type Watcher struct {
	path     string
	log      *slog.Logger
	onReload func(*Policy, error)
	debounce time.Duration

	cur atomic.Pointer[Policy]

	mu      sync.Mutex // serializes reloads; guards the fields below
	lastSum string     // digest of the last content tried, good or bad
	lastErr error      // its error, nil when it loaded
}

// WatcherOption configures a Watcher.
type WatcherOption func(*Watcher)

// WithReloadHook sets a function called after every reload that found new
// content in the file: with the new policy and a nil error when it is now
// in force, with nil and the error when it was rejected. A reload that finds
// the content it already tried does not call it. Use it for metrics (a
// reload counter, a "last reload succeeded" gauge). It runs on the
// reloading goroutine, under the Watcher's reload lock: keep it short and do
// not call Reload from it.
func WithReloadHook(f func(p *Policy, err error)) WatcherOption {
	return func(w *Watcher) { w.onReload = f }
}

// WithReloadDebounce sets how long Run waits after the last change to the
// directory before it reloads, so that a burst of events from one save (an
// editor's write, rename and chmod; the kubelet's symlink swap) costs one
// reload of the finished file. The default is 100 ms; d ≤ 0 keeps it.
func WithReloadDebounce(d time.Duration) WatcherOption {
	return func(w *Watcher) {
		if d > 0 {
			w.debounce = d
		}
	}
}

// NewWatcher loads the policy file at path and returns a Watcher holding it.
// It fails if the file does not load: a service should not start without a
// valid policy. log receives reload results under component=policy; nil
// discards them.
func NewWatcher(path string, log *slog.Logger, opts ...WatcherOption) (*Watcher, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, fmt.Errorf("policy path %s: %w", path, err)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	w := &Watcher{
		path:     abs,
		log:      log.With("component", "policy", "path", abs),
		debounce: 100 * time.Millisecond,
	}
	for _, o := range opts {
		o(w)
	}
	p, err := LoadFile(abs)
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
func (w *Watcher) Current() *Policy { return w.cur.Load() }

// Reload re-reads the file and, if it loads, puts it in force and logs the
// change. If it does not, the current policy stays and Reload returns the
// error (it does not log it: the caller decides). Content identical to the
// last content tried is not parsed again: Reload then returns that
// attempt's result, so a SIGHUP on a file that is still broken reports the
// same error.
func (w *Watcher) Reload() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	data, err := readPolicyFile(w.path)
	if err != nil {
		// Not a verdict on any content (the file may be missing for a moment
		// mid-rename): the next read is judged afresh.
		w.lastSum, w.lastErr = "", nil
		return err
	}
	sum := digestOf(data)
	if sum == w.lastSum {
		return w.lastErr
	}
	p, err := Parse(data)
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

func (w *Watcher) hook(p *Policy, err error) {
	if w.onReload != nil {
		w.onReload(p, err)
	}
}

// Run watches the policy file's directory and reloads the file after each
// change (see Watcher), logging failures at Error; it also reloads once when
// the watch is in place, to catch a change made before. It returns nil when
// ctx is done, or an error if the directory cannot be watched. Call it once,
// on a goroutine its owner waits for.
func (w *Watcher) Run(ctx context.Context) error {
	return filewatch.Run(ctx, w.path, w.debounce, w.log, "policy", w.reloadAndLog)
}

func (w *Watcher) reloadAndLog() {
	if err := w.Reload(); err != nil {
		w.log.Error("policy reload failed; the last good policy stays in force",
			"err", err, "digest", w.Current().Digest())
	}
}
