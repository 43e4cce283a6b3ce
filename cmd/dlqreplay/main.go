// Command dlqreplay republishes dead-lettered usage events to the subjects
// they came from, once the cause is fixed, and removes them from the
// dead-letter stream (stream.Replay). It reads QF_NATS_URL, QF_STREAM,
// QF_DLQ_STREAM and QF_SUBJECT_PREFIX like the services.
//
//	go tool task dlq-replay -- -reason max_deliver
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/kelseyhightower/envconfig"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/internal/config"
	"quotaflow/pkg/events/stream"
)

func main() {
	reason := flag.String("reason", "", "replay only dead letters of this reason (e.g. invalid, max_deliver); empty: all")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	n, err := run(ctx, *reason)
	stop()
	if err != nil {
		fmt.Fprintf(os.Stderr, "dlqreplay: %v (replayed %d)\n", err, n)
		os.Exit(1)
	}
	fmt.Printf("replayed %d dead letters\n", n)
}

func run(ctx context.Context, reason string) (int, error) {
	cfg := config.DefaultNATS
	if err := envconfig.Process("QF", &cfg); err != nil {
		return 0, err
	}
	nc, err := nats.Connect(cfg.NATSURL, nats.Timeout(5*time.Second))
	if err != nil {
		return 0, fmt.Errorf("nats: %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return 0, err
	}
	return stream.Replay(ctx, js, cfg.Config, reason)
}
