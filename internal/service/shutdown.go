package service

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
)

// ShutdownStep runs one step of a graceful shutdown under its own deadline
// and logs a failure, so the remaining steps still run.
func ShutdownStep(log *slog.Logger, what string, timeout time.Duration, f func(context.Context) error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if err := f(ctx); err != nil {
		log.Warn("shutdown step failed", "step", what, "err", err)
	}
}

// DrainNATS lets pending publishes and acks reach the server, then closes
// the connection; past ctx's deadline it closes it at once.
func DrainNATS(ctx context.Context, nc *nats.Conn) error {
	closed := make(chan struct{})
	nc.SetClosedHandler(func(*nats.Conn) { close(closed) })
	if err := nc.Drain(); err != nil {
		nc.Close()
		if errors.Is(err, nats.ErrConnectionClosed) {
			return nil
		}
		return err
	}
	select {
	case <-closed:
		return nil
	case <-ctx.Done():
		nc.Close()
		return ctx.Err()
	}
}
