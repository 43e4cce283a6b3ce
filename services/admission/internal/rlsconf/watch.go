package rlsconf

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"quotaflow/internal/filewatch"
)

// Watcher keeps the configuration of a file or directory current: Current
// is one atomic load; Run reloads on every change and Reload on SIGHUP. A
// configuration that fails to load leaves the last good one in force, and
// the failure comes back from Reload and reaches the log and the OnReload
// hook. Create one with NewWatcher; its methods are safe for concurrent use.
type Watcher struct {
	path     string
	log      *slog.Logger
	onReload func(error)

	cur atomic.Pointer[Config]

	mu      sync.Mutex // serializes reloads; guards lastSum
	lastSum string
}

// NewWatcher loads path (Load) and returns a watcher holding it; a path
// that does not load is an error, as a service should not start without its
// configuration. onReload, when set, is called after every reload that found
// new content: nil when it is in force, the error when it was rejected.
func NewWatcher(path string, log *slog.Logger, onReload func(error)) (*Watcher, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, fmt.Errorf("QF_ENVOY_RATELIMIT_CONFIG %s: %w", path, err)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	c, err := Load(abs)
	if err != nil {
		return nil, err
	}
	w := &Watcher{path: abs, log: log.With("component", "envoy_ratelimit_config", "path", abs), onReload: onReload, lastSum: c.Digest()}
	w.cur.Store(c)
	if c.Domains() == 0 {
		w.log.Warn("envoy ratelimit configuration has no domain: every descriptor is OK without a limit")
	}
	return w, nil
}

// Current returns the configuration in force; never nil.
func (w *Watcher) Current() *Config { return w.cur.Load() }

// Reload loads the path again and puts it in force when it loads.
// Content identical to the last content tried is not reported again.
func (w *Watcher) Reload() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	c, err := Load(w.path)
	if err != nil {
		w.lastSum = ""
		if w.onReload != nil {
			w.onReload(err)
		}
		return err
	}
	if c.Digest() == w.lastSum {
		return nil
	}
	w.lastSum = c.Digest()
	old := w.cur.Swap(c)
	w.log.Info("envoy ratelimit configuration reloaded", "digest", c.Digest(), "previous_digest", old.Digest(), "domains", c.Domains())
	if w.onReload != nil {
		w.onReload(nil)
	}
	return nil
}

// Watch keeps the configuration current until ctx ends: it reloads after
// each change of the file (of any file, for a directory) and on SIGHUP,
// logging what it rejected. Call it once, on a goroutine its owner waits for.
func (w *Watcher) Watch(ctx context.Context) {
	reload := func() {
		if err := w.Reload(); err != nil {
			w.log.Error("envoy ratelimit configuration rejected; the last good one stays in force", "err", err)
		}
	}
	filewatch.OnSIGHUP(ctx, w.log, "envoy ratelimit configuration", func(ctx context.Context) error {
		return filewatch.Run(ctx, w.path, 100*time.Millisecond, w.log, "envoy ratelimit configuration", reload)
	}, reload)
}
