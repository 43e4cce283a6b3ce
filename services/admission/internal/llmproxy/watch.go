package llmproxy

import (
	"context"
	"crypto/sha256"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"quotaflow/internal/filewatch"
	"quotaflow/pkg/yamldoc"
)

// Watcher keeps the gateway's Config current: Current is one atomic load;
// Watch rebuilds it after each change of QF_GATEWAY_FILE and on SIGHUP, so
// keys rotate and routes change without a restart. Content that does not
// build leaves the last good Config in force, is logged and reported to
// the OnReload hook. Create one with NewWatcher; its methods are safe for
// concurrent use.
type Watcher struct {
	s        Settings
	path     string // absolute; "" without a file
	getenv   func(string) string
	log      *slog.Logger
	onReload func(error)

	cur atomic.Pointer[Config]

	mu      sync.Mutex // serializes reloads; guards lastSum
	lastSum [sha256.Size]byte
}

// NewWatcher builds the Config of s and its file; a failure is an error, as
// the gateway should not start with a configuration it cannot read.
// getenv reads the upstreams' api_key_env variables (os.Getenv); onReload,
// when set, is told of every reload that found new content: nil when in
// force, the error when rejected.
func NewWatcher(s Settings, getenv func(string) string, log *slog.Logger, onReload func(error)) (*Watcher, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	w := &Watcher{s: s, getenv: getenv, log: log.With("component", "gateway_config")}
	if s.File != "" {
		abs, err := filepath.Abs(s.File)
		if err != nil {
			return nil, fmt.Errorf("QF_GATEWAY_FILE %s: %w", s.File, err)
		}
		w.path = abs
		w.log = w.log.With("path", abs)
	}
	if _, err := w.reload(); err != nil {
		return nil, err
	}
	w.onReload = onReload // not for the first load: nothing was reloaded
	return w, nil
}

// Current returns the Config in force; never nil.
func (w *Watcher) Current() *Config { return w.cur.Load() }

// Reload reads the file again and puts its Config in force when it builds;
// content identical to the last tried is not built again.
func (w *Watcher) Reload() error {
	changed, err := w.reload()
	if changed && w.onReload != nil {
		w.onReload(err)
	}
	return err
}

func (w *Watcher) reload() (changed bool, err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	var data []byte
	if w.path != "" {
		if data, err = yamldoc.ReadFile(w.path, MaxFileSize); err != nil {
			w.lastSum = [sha256.Size]byte{} // judge the next read afresh
			return true, fmt.Errorf("QF_GATEWAY_FILE: %w", err)
		}
		sum := sha256.Sum256(data)
		if w.cur.Load() != nil && sum == w.lastSum {
			return false, nil
		}
		w.lastSum = sum
	}
	c, err := Build(w.s, data, w.getenv)
	if err != nil {
		return true, err
	}
	w.cur.Store(c)
	w.log.Info("gateway configuration in force", "upstreams", len(c.upstreams), "keys", len(c.keys),
		"trusted_headers", c.trusted != nil)
	return true, nil
}

// Watch keeps the file's configuration current until ctx ends (see
// Watcher). Without a file it returns at once. Call it once, on a
// goroutine its owner waits for.
func (w *Watcher) Watch(ctx context.Context) {
	if w.path == "" {
		return
	}
	filewatch.OnSIGHUP(ctx, w.log, "gateway file", func(ctx context.Context) error {
		return filewatch.Run(ctx, w.path, 100*time.Millisecond, w.log, "gateway file", w.reloadAndLog)
	}, w.reloadAndLog)
}

func (w *Watcher) reloadAndLog() {
	if err := w.Reload(); err != nil {
		w.log.Error("gateway file rejected; the last good configuration stays in force", "err", err)
	}
}
