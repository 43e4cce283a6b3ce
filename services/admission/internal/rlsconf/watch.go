package rlsconf

import (
	"log/slog"

	"quotaflow/internal/filewatch"
)

// Watcher keeps the configuration of a file or directory current
// (filewatch.Value): Current is one atomic load, Watch reloads on every
// change and on SIGHUP, and a configuration that fails to load leaves the
// last good one in force. Create one with NewWatcher.
type Watcher = filewatch.Value[Config]

// NewWatcher loads path (Load) and returns a watcher holding it; a path
// that does not load is an error, as a service should not start without its
// configuration. onReload, when set, is called after every reload that found
// new content: nil when it is in force, the error when it was rejected.
func NewWatcher(path string, log *slog.Logger, onReload func(error)) (*Watcher, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = log.With("component", "envoy_ratelimit_config")
	o := filewatch.ValueOptions[Config]{
		What:     "envoy ratelimit configuration",
		Read:     read,
		Describe: func(c *Config) []any { return []any{"domains", c.Domains()} },
		Log:      log,
	}
	if onReload != nil {
		o.OnReload = func(_ *Config, err error) { onReload(err) }
	}
	w, err := filewatch.NewValue(path, o)
	if err != nil {
		return nil, err
	}
	if w.Current().Domains() == 0 {
		log.Warn("envoy ratelimit configuration has no domain: every descriptor is OK without a limit", "path", path)
	}
	return w, nil
}

// read reads the files at path (Load) for a Watcher.
func read(path string) (filewatch.Content[Config], error) {
	files, err := readFiles(path)
	if err != nil {
		return filewatch.Content[Config]{}, err
	}
	return filewatch.Content[Config]{Digest: digest(files), Parse: func() (*Config, error) { return Parse(files...) }}, nil
}
