package service

import (
	"fmt"
	"log/slog"
	"time"

	"quotaflow/internal/filewatch"
	"quotaflow/pkg/limits/policy"
)

// PolicyWatcher keeps the current policy of a file that operators may edit
// while the service runs (filewatch.Value): Current is one atomic load, a
// file that fails to load or validate leaves the last good policy in force.
// Create one with NewPolicyWatcher or WatchPolicy.
type PolicyWatcher = filewatch.Value[policy.Policy]

// PolicyWatcherOption configures a PolicyWatcher.
type PolicyWatcherOption func(*filewatch.ValueOptions[policy.Policy])

// WithPolicyReloadHook sets a function called after every reload that found
// new content in the file: with the new policy and a nil error when it is
// now in force, with nil and the error when it was rejected. A reload that
// finds the content it already tried does not call it. Use it for metrics (a
// reload counter, a "last reload succeeded" gauge). It runs on the
// reloading goroutine, under the watcher's reload lock: keep it short and do
// not call Reload from it.
func WithPolicyReloadHook(f func(p *policy.Policy, err error)) PolicyWatcherOption {
	return func(o *filewatch.ValueOptions[policy.Policy]) { o.OnReload = f }
}

// WithPolicyReloadDebounce sets how long Run waits after the last change to
// the directory before it reloads (filewatch.ValueOptions.Debounce). The
// default is 100 ms; d ≤ 0 keeps it.
func WithPolicyReloadDebounce(d time.Duration) PolicyWatcherOption {
	return func(o *filewatch.ValueOptions[policy.Policy]) { o.Debounce = d }
}

// NewPolicyWatcher loads the policy file at path and returns a watcher
// holding it. It fails if the file does not load: a service should not start without a
// valid policy. log receives reload results under component=policy; nil
// discards them.
func NewPolicyWatcher(path string, log *slog.Logger, opts ...PolicyWatcherOption) (*PolicyWatcher, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	o := filewatch.ValueOptions[policy.Policy]{
		What: "policy",
		Read: readPolicy,
		Describe: func(p *policy.Policy) []any {
			return []any{"plans", len(p.Plans), "tenants", len(p.Tenants), "endpoints", len(p.Endpoints)}
		},
		Log: log.With("component", "policy"),
	}
	for _, opt := range opts {
		opt(&o)
	}
	return filewatch.NewValue(path, o)
}

// readPolicy reads the policy file at path; its digest is the policy's
// (policy.DigestOf).
func readPolicy(path string) (filewatch.Content[policy.Policy], error) {
	data, err := policy.ReadFile(path)
	if err != nil {
		return filewatch.Content[policy.Policy]{}, err
	}
	return filewatch.Content[policy.Policy]{Digest: policy.DigestOf(data), Parse: func() (*policy.Policy, error) {
		p, err := policy.Parse(data)
		if err != nil {
			return nil, fmt.Errorf("load policy %s: %w", path, err)
		}
		return p, nil
	}}, nil
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
	s.Go("policy file", w.Watch)
	return w, nil
}
