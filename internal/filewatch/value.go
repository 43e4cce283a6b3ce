package filewatch

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"
)

// Content is what a Value read at its path: a digest that is equal for
// equal content, and the function that parses it.
type Content[T any] struct {
	Digest string
	Parse  func() (*T, error)
}

// ValueOptions configure a Value. Read is required.
type ValueOptions[T any] struct {
	// What names the file in logs and errors ("policy").
	What string
	// Read reads what is at the path now. Its error is no verdict on any
	// content (a file missing for a moment mid-rename): the next read is
	// judged afresh.
	Read func(path string) (Content[T], error)
	// Describe returns the attributes logged beside a reload (counts of
	// what the value holds); nil logs none.
	Describe func(v *T) []any
	// OnReload, when set, is called after every reload that found content
	// not tried before: with the value and nil when it is now in force,
	// with nil and the error when it was rejected (for a reload counter).
	// It runs under the reload lock: keep it short and do not call Reload
	// from it. The first load does not call it.
	OnReload func(v *T, err error)
	// Debounce is how long Run waits after the last change in the
	// directory before it reloads, so that one save (an editor's write,
	// rename and chmod; the kubelet's symlink swap) costs one reload of
	// the finished file. Default 100 ms.
	Debounce time.Duration
	// Log receives reloads and rejections, with the path; nil discards
	// them.
	Log *slog.Logger
}

// Value keeps the parsed content of a file (or a directory) that operators
// may edit while a service runs. Current is what request handlers call: one
// atomic load. Reload reads the path again; Run reloads after each change
// of the file (see Run for how: editors' rename-on-save and ConfigMap
// symlink swaps count), Watch also on SIGHUP. Content that fails to read or
// parse leaves the last good value in force; the failure comes back from
// Reload and reaches the log and OnReload with its precise error. Content
// identical to the last content tried is not parsed again: Reload returns
// that attempt's result, so a SIGHUP on a file still broken reports the same
// error, and OnReload is not called again.
//
// A path that is itself a symlink into another directory is only seen to
// change through SIGHUP. Create one with NewValue (the zero Value is not
// usable); its methods are safe for concurrent use.
type Value[T any] struct {
	path string
	o    ValueOptions[T]

	cur atomic.Pointer[T]

	mu      sync.Mutex // serializes reloads; guards the fields below
	inForce string     // digest of the value in force
	lastSum string     // digest of the last content tried, good or bad ("" none)
	lastErr error      // its error, nil when it is in force
}

// NewValue loads the value at path and returns a Value holding it. It
// fails when the path does not load: a service should not start without
// its configuration.
func NewValue[T any](path string, o ValueOptions[T]) (*Value[T], error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, fmt.Errorf("%s path %s: %w", o.What, path, err)
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	o.Log = o.Log.With("path", abs)
	if o.Debounce <= 0 {
		o.Debounce = 100 * time.Millisecond
	}
	c, err := o.Read(abs)
	if err != nil {
		return nil, err
	}
	v, err := c.Parse()
	if err != nil {
		return nil, err
	}
	w := &Value[T]{path: abs, o: o, inForce: c.Digest, lastSum: c.Digest}
	w.cur.Store(v)
	return w, nil
}

// Current returns the value in force. It never returns nil and never
// blocks; hold the result for the whole of one request so that a reload in
// between does not mix two values.
func (w *Value[T]) Current() *T { return w.cur.Load() }

// Reload reads the path again and, when its content parses, puts it in
// force and logs the change. When it does not, the value in force stays and
// Reload returns the error (it does not log it: the caller decides).
func (w *Value[T]) Reload() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	c, err := w.o.Read(w.path)
	if err != nil {
		w.lastSum, w.lastErr = "", nil
		return err
	}
	if c.Digest == w.lastSum {
		return w.lastErr
	}
	v, err := c.Parse()
	w.lastSum, w.lastErr = c.Digest, err
	if err != nil {
		w.hook(nil, err)
		return err
	}
	w.cur.Store(v)
	attrs := []any{"digest", c.Digest, "previous_digest", w.inForce}
	if w.o.Describe != nil {
		attrs = append(attrs, w.o.Describe(v)...)
	}
	w.inForce = c.Digest
	w.o.Log.Info(w.o.What+" reloaded", attrs...)
	w.hook(v, nil)
	return nil
}

func (w *Value[T]) hook(v *T, err error) {
	if w.o.OnReload != nil {
		w.o.OnReload(v, err)
	}
}

// Run watches the path's directory and reloads after each change (see the
// package doc), logging rejected content at Error; it also reloads once
// when the watch is in place, to catch a change made before. It returns
// nil when ctx is done, or an error if the directory cannot be watched.
// Call it once, on a goroutine its owner waits for.
func (w *Value[T]) Run(ctx context.Context) error {
	return Run(ctx, w.path, w.o.Debounce, w.o.Log, w.o.What, func() { w.reloadAndLog("change") })
}

// Watch keeps the value current until ctx ends: Run, and a reload on every
// SIGHUP. Call it once, on a goroutine its owner waits for.
func (w *Value[T]) Watch(ctx context.Context) {
	OnSIGHUP(ctx, w.o.Log, w.o.What, w.Run, func() { w.reloadAndLog("SIGHUP") })
}

func (w *Value[T]) reloadAndLog(trigger string) {
	if err := w.Reload(); err != nil {
		w.mu.Lock()
		inForce := w.inForce
		w.mu.Unlock()
		w.o.Log.Error(w.o.What+" rejected; the last good one stays in force",
			"trigger", trigger, "err", err, "digest", inForce)
	}
}
