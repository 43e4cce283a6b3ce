package deliver

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"quotaflow/internal/filewatch"
)

// Watcher keeps the webhooks of QF_WEBHOOKS_FILE in force while the
// alerter runs: Reload re-reads the file (call it on SIGHUP) and Run
// reloads it whenever it changes. A file that does not parse or validate
// is rejected with its precise error (the file and the path of the
// mistake, such as "webhooks[1].url") and the last good webhooks stay in
// force.
//
// Run watches the file's directory rather than the file, so it sees
// editors that save by renaming a new file over the old one and
// Kubernetes ConfigMap volumes (whose "..data" symlink is swapped).
//
// Create one with NewWatcher; its methods are safe for concurrent use.
type Watcher struct {
	path     string
	kinds    []string
	apply    func([]Webhook) error
	log      *slog.Logger
	debounce time.Duration

	mu      sync.Mutex // serializes reloads; guards the fields below
	last    []byte     // the content last tried, good or bad
	lastErr error      // its error, nil when it is in force
}

// NewWatcher returns a Watcher of the webhooks file at path. Each new
// valid content is handed to apply (Deliverer.SetWebhooks); kinds are the
// alert kinds a webhook may name. log receives reload results.
func NewWatcher(path string, kinds []string, apply func([]Webhook) error, log *slog.Logger) (*Watcher, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, fmt.Errorf("webhooks file %s: %w", path, err)
	}
	return &Watcher{
		path: abs, kinds: kinds, apply: apply, debounce: 100 * time.Millisecond,
		log: log.With("component", "webhooks", "path", abs),
	}, nil
}

// SetDebounce sets how long Run waits after the last change in the
// directory before it reloads, so one save (write, rename, chmod) costs
// one reload of the finished file. The default is 100 ms.
func (w *Watcher) SetDebounce(d time.Duration) { w.debounce = d }

// Reload re-reads the file and, when it is valid, puts its webhooks in
// force. When it is not, the webhooks in force stay and Reload returns the
// error (naming the file and the mistake). Content identical to the last
// content tried is not applied again: Reload returns that attempt's
// result.
func (w *Watcher) Reload() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	b, err := os.ReadFile(w.path)
	if err != nil {
		// Perhaps missing for a moment mid-rename: judge the next read afresh.
		w.last, w.lastErr = nil, nil
		return fmt.Errorf("webhooks file %s: %w", w.path, err)
	}
	if w.last != nil && bytes.Equal(b, w.last) {
		return w.lastErr
	}
	hooks, err := Parse(b, w.kinds)
	if err == nil {
		err = w.apply(hooks)
	}
	if err != nil {
		err = fmt.Errorf("reload %s: %w", w.path, err)
	}
	w.last, w.lastErr = b, err
	if err != nil {
		return err
	}
	names := make([]string, len(hooks))
	for i, h := range hooks {
		names[i] = h.Name
	}
	w.log.Info("webhooks reloaded", "webhooks", names)
	return nil
}

// Run watches the file's directory and reloads the file after each change
// until ctx ends, logging rejected content at Error; it also reloads once
// when the watch is in place, to catch a change made before. It returns
// nil when ctx is done, or an error when the directory cannot be watched
// (SIGHUP still reloads).
func (w *Watcher) Run(ctx context.Context) error {
	return filewatch.Run(ctx, w.path, w.debounce, w.log, "webhooks file", func() { w.ReloadAndLog("change") })
}

// Watch keeps the webhooks current until ctx ends: it reloads the file
// when it changes (Run) and on SIGHUP.
func (w *Watcher) Watch(ctx context.Context) {
	filewatch.OnSIGHUP(ctx, w.log, "webhooks file", w.Run, func() { w.ReloadAndLog("SIGHUP") })
}

// ReloadAndLog calls Reload and logs a rejection at Error, saying that
// the last good webhooks stay in force; cause says what triggered it.
func (w *Watcher) ReloadAndLog(cause string) {
	if err := w.Reload(); err != nil {
		w.log.Error("webhooks file rejected; the last good webhooks stay in force", "trigger", cause, "err", err)
	}
}
