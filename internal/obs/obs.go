// Package obs gives every quotaflow service the same operational surface:
// a JSON slog logger at a configured level, one Prometheus registry per
// process, and the ops HTTP handler serving /metrics, /healthz and /readyz
// from a Readiness that components report into.
//
// Only the services under services/ import it.
package obs

import (
	"fmt"
	"io"
	"log/slog"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// ParseLevel reads a log level: debug, info, warn (or warning) or error,
// in any case. The empty string is info.
func ParseLevel(s string) (slog.Level, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "debug":
		return slog.LevelDebug, nil
	case "", "info":
		return slog.LevelInfo, nil
	case "warn", "warning":
		return slog.LevelWarn, nil
	case "error":
		return slog.LevelError, nil
	}
	return 0, fmt.Errorf("log level %q: want debug, info, warn or error", s)
}

// NewLogger returns a logger writing JSON lines to w at level (see
// ParseLevel), with the attribute service set on every record.
func NewLogger(w io.Writer, level, service string) (*slog.Logger, error) {
	l, err := ParseLevel(level)
	if err != nil {
		return nil, err
	}
	h := slog.NewJSONHandler(w, &slog.HandlerOptions{Level: l})
	return slog.New(h).With("service", service), nil
}

// Register registers cs on reg, in order, stopping at the first error;
// with reg nil it registers nothing (a component used without metrics).
func Register(reg prometheus.Registerer, cs ...prometheus.Collector) error {
	if reg == nil {
		return nil
	}
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}

// NewRegistry returns a Prometheus registry holding the Go runtime and
// process collectors. Services create one in run and hand it to each
// component as a prometheus.Registerer; nothing registers globally.
func NewRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	)
	return reg
}
