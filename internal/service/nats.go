package service

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// natsReconnectWait is how often a lost NATS connection is retried: often
// enough that queued events flow again soon after NATS is back.
const natsReconnectWait = 500 * time.Millisecond

// ConnectNATS connects service name ("admission") to the NATS server(s) of
// url the one way every service does: it returns at once even while NATS
// is down and reconnects forever, logging a late connect, disconnects,
// reconnects and asynchronous errors. The stack drains the connection in its turn, so
// pending publishes and acks reach the server. opts configure the returned
// JetStream.
func ConnectNATS(s *Stack, name, url string, opts ...jetstream.JetStreamOpt) (*nats.Conn, jetstream.JetStream, error) {
	log := s.log
	nc, err := nats.Connect(url,
		nats.Name("quotaflow-"+name),
		nats.MaxReconnects(-1),
		nats.RetryOnFailedConnect(true),
		nats.ReconnectWait(natsReconnectWait),
		nats.DrainTimeout(s.timeout),
		nats.ConnectHandler(func(*nats.Conn) { log.Info("nats connected") }), // after a failed first try
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil { // nil: closed by us
				log.Warn("nats disconnected", "err", err)
			}
		}),
		nats.ReconnectHandler(func(*nats.Conn) { log.Info("nats reconnected") }),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { log.Warn("nats error", "err", err) }),
	)
	if err != nil {
		return nil, nil, fmt.Errorf("nats: %w", err)
	}
	s.Push("nats", func(ctx context.Context) error { return drainNATS(ctx, nc) })
	js, err := jetstream.New(nc, opts...)
	if err != nil {
		return nil, nil, fmt.Errorf("jetstream: %w", err)
	}
	return nc, js, nil
}

// drainNATS lets pending publishes and acks reach the server, then closes
// the connection; past ctx's deadline it closes it at once.
func drainNATS(ctx context.Context, nc *nats.Conn) error {
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
