package llmproxy

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"

	"quotaflow/internal/filewatch"
	"quotaflow/pkg/yamldoc"
)

// Watcher keeps the gateway's Config current: Current is one atomic load;
// Watch rebuilds it after each change of QF_GATEWAY_FILE and on SIGHUP
// (filewatch.Value), so keys rotate and routes change without a restart.
// Content that does not build leaves the last good Config in force, is
// logged and reported to the onReload hook. Without a file the Config of
// the environment never changes. Create one with NewWatcher; its methods
// are safe for concurrent use.
type Watcher struct {
	static *Config                  // without a file
	file   *filewatch.Value[Config] // with one
}

// NewWatcher builds the Config of s and its file; a failure is an error, as
// the gateway should not start with a configuration it cannot read.
// getenv reads the upstreams' api_key_env variables (os.Getenv); onReload,
// when set, is told of every reload that found new content: nil when in
// force, the error when rejected.
func NewWatcher(s Settings, getenv func(string) string, log *slog.Logger, onReload func(error)) (*Watcher, error) {
	if s.GatewayFile == "" {
		c, err := Build(s, nil, getenv)
		return &Watcher{static: c}, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	v, err := filewatch.NewValue(s.GatewayFile, filewatch.ValueOptions[Config]{
		What: "gateway file",
		Read: func(path string) (filewatch.Content[Config], error) {
			data, err := yamldoc.ReadFile(path, MaxFileSize)
			if err != nil {
				return filewatch.Content[Config]{}, fmt.Errorf("QF_GATEWAY_FILE: %w", err)
			}
			sum := sha256.Sum256(data)
			return filewatch.Content[Config]{Digest: hex.EncodeToString(sum[:]),
				Parse: func() (*Config, error) { return Build(s, data, getenv) }}, nil
		},
		Describe: func(c *Config) []any {
			return []any{"upstreams", len(c.upstreams), "keys", len(c.keys), "trusted_headers", c.trusted != nil}
		},
		OnReload: func(_ *Config, err error) {
			if onReload != nil {
				onReload(err)
			}
		},
		Log: log.With("component", "gateway_config"),
	})
	if err != nil {
		return nil, err
	}
	return &Watcher{file: v}, nil
}

// Current returns the Config in force; never nil.
func (w *Watcher) Current() *Config {
	if w.file == nil {
		return w.static
	}
	return w.file.Current()
}

// Watch keeps the file's configuration current until ctx ends (see
// Watcher). Without a file it returns at once. Call it once, on a
// goroutine its owner waits for.
func (w *Watcher) Watch(ctx context.Context) {
	if w.file != nil {
		w.file.Watch(ctx)
	}
}
