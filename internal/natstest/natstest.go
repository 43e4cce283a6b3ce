// Package natstest gives service tests NATS JetStream for real: the
// server the services use (QF_NATS_URL, else the local default) with
// streams and a subject prefix of the test's own, deleted when it ends, and
// embedded servers (nats-server as a library) that a test may stop and
// start again on the same store.
package natstest

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/internal/config"
	"quotaflow/internal/e2e"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

// URL is the NATS server tests use.
func URL() string { return config.NATSURL() }

// Connect connects to url with opts, closing the connection at cleanup,
// and fails the test when the server is not reachable.
func Connect(t testing.TB, url string, opts ...nats.Option) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		t.Fatalf("nats at %s is not reachable (run `go tool task deps`): %v", url, err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return nc, js
}

// Streams creates a usage stream, a dead-letter stream and a subject
// prefix named after name and a random suffix, on top of base (its
// redelivery settings are kept), and deletes both streams at cleanup. It
// returns the settings with base's zero ones at their defaults, as Ensure
// took them: a service's Config validates with them (config.NATS refuses a
// zero setting).
func Streams(t testing.TB, js jetstream.JetStream, name string, base stream.Config) stream.Config {
	t.Helper()
	sfx := strings.ToUpper(name + "_" + e2e.RandomHex(6))
	cfg := base
	cfg.Stream, cfg.DLQStream = "QFTEST_"+sfx, "QFTEST_"+sfx+"_DLQ"
	cfg.SubjectPrefix = "qftest_" + strings.ToLower(sfx)
	if cfg.MaxAge == 0 {
		cfg.MaxAge, cfg.Duplicates, cfg.DLQMaxAge = 10*time.Minute, 5*time.Minute, 10*time.Minute
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := stream.Ensure(ctx, js, cfg); err != nil {
		t.Fatalf("stream.Ensure = %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = js.DeleteStream(ctx, cfg.Stream)
		_ = js.DeleteStream(ctx, cfg.DLQStream)
	})
	return cfg.WithDefaults()
}

// StreamMsgs is the number of messages the stream name holds now; it fails the
// test when the stream or its state cannot be read.
func StreamMsgs(t testing.TB, js jetstream.JetStream, name string) uint64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, name)
	if err != nil {
		t.Fatalf("stream %s: %v", name, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatalf("stream %s info: %v", name, err)
	}
	return info.State.Msgs
}

// StreamEvents is how many copies of each event id the stream name holds
// now, batches expanded (stream.EventIDs); it fails the test when the
// stream cannot be read. Tests count events with it, never messages.
func StreamEvents(t testing.TB, js jetstream.JetStream, name string) map[string]int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ids, err := stream.EventIDs(ctx, js, name)
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

// StoredEvents is every event the stream name holds now, in order,
// batches expanded (stream.ReadEvents); it fails the test when the stream
// cannot be read.
func StoredEvents(t testing.TB, js jetstream.JetStream, name string) []events.Event {
	t.Helper()
	evs, err := ReadStoredEvents(js, name)
	if err != nil {
		t.Fatal(err)
	}
	return evs
}

// ReadStoredEvents is StoredEvents returning the error, for a poll that
// must retry a read that fails for a while (a server restarting).
func ReadStoredEvents(js jetstream.JetStream, name string) ([]events.Event, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var evs []events.Event
	if err := stream.ReadEvents(ctx, js, name, func(ev events.Event) { evs = append(evs, ev) }); err != nil {
		return nil, fmt.Errorf("reading stream %s: %w", name, err)
	}
	return evs, nil
}

// Embedded starts a nats-server with JetStream storing in dir, on port
// (-1: any free port; pass the first one's port to restart it in place),
// and waits until it accepts connections. Stop it with Stop.
func Embedded(t testing.TB, dir string, port int) *server.Server {
	t.Helper()
	s, err := server.NewServer(&server.Options{
		Host: "127.0.0.1", Port: port, JetStream: true, StoreDir: dir, NoLog: true, NoSigs: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		t.Fatal("embedded nats-server did not start")
	}
	return s
}

// Stop shuts an embedded server down and waits until it has.
func Stop(s *server.Server) {
	s.Shutdown()
	s.WaitForShutdown()
}
