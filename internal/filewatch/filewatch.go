// Package filewatch reloads a configuration file when it changes and on
// SIGHUP. It watches the file's directory, not the file, so that editors'
// rename-on-save and Kubernetes ConfigMap symlink swaps count as changes.
package filewatch

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/fsnotify/fsnotify"
)

// Run calls reload once when the watch is in place (to catch a change made
// before it), then after each change of the file at path, debounced: a
// burst of events within debounce is one reload. It returns nil when ctx is
// done, or an error when the directory cannot be watched. what names the
// file in logs. When path is a directory, a change of any file in it counts.
func Run(ctx context.Context, path string, debounce time.Duration, log *slog.Logger, what string, reload func()) error {
	fw, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("watch %s: %w", what, err)
	}
	defer fw.Close()
	dir, base := filepath.Split(path)
	if st, err := os.Stat(path); err == nil && st.IsDir() {
		dir, base = path, ""
	}
	if err := fw.Add(dir); err != nil {
		return fmt.Errorf("watch %s directory %s: %w", what, dir, err)
	}
	reload()

	timer := time.NewTimer(debounce)
	timer.Stop()
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case ev, ok := <-fw.Events:
			if !ok {
				return nil
			}
			if relevant(ev, base) {
				timer.Reset(debounce)
			}
		case err, ok := <-fw.Errors:
			if !ok {
				return nil
			}
			// An overflow may have dropped the event we wanted: reload anyway.
			log.Warn(what+" watch error", "err", err)
			timer.Reset(debounce)
		case <-timer.C:
			reload()
		}
	}
}

// relevant reports whether a change in the watched directory may have
// changed the file (any change, for a watched directory, base ""): an event on the file itself, or on the "..data" style
// entries through which a ConfigMap volume's files are linked. Attribute
// changes alone are ignored: indexers and backup tools make many.
func relevant(ev fsnotify.Event, base string) bool {
	if ev.Op == fsnotify.Chmod {
		return false
	}
	name := filepath.Base(ev.Name)
	return base == "" || name == base || strings.HasPrefix(name, "..")
}

// OnSIGHUP runs watch (a file watch such as Run) and calls reload on every
// SIGHUP until ctx ends; it returns once watch has returned too. A watch
// that fails is logged: SIGHUP still reloads.
func OnSIGHUP(ctx context.Context, log *slog.Logger, what string, watch func(context.Context) error, reload func()) {
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() {
		if err := watch(ctx); err != nil {
			log.Error(what+" watch failed; reload with SIGHUP", "err", err)
		}
	})
	for {
		select {
		case <-hup:
			reload()
		case <-ctx.Done():
			return
		}
	}
}
