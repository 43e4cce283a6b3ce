// Command natsbatch measures what nats-server spends per event published
// and consumed, one event per message against batches (issue 13): on a
// private nats-server, in interleaved rounds, N actual events published
// with stream.Publisher.PublishBatch in calls of -call events and consumed
// with stream.Process, reading the server's CPU from /proc around each.
// "single" is a publisher whose max payload fits one event a message,
// which is how every event travelled before batches.
//
//	go run ./bench/natsbatch -n 20000 -rounds 3
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/bench/internal/proc"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "natsbatch:", err)
		os.Exit(1)
	}
}

func run() error {
	n := flag.Int("n", 20000, "events per round and mode")
	call := flag.Int("call", 500, "events per PublishBatch call (the outbox's round)")
	rounds := flag.Int("rounds", 3, "interleaved rounds")
	bin := flag.String("nats", "nats-server", "the nats-server binary")
	flag.Parse()

	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	dir, err := os.MkdirTemp("", "natsbatch")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	srv := exec.Command(*bin, "-a", "127.0.0.1", "-p", fmt.Sprint(port), "-js", "-sd", dir)
	if err := srv.Start(); err != nil {
		return err
	}
	defer func() { _ = srv.Process.Kill(); _ = srv.Wait() }()
	var nc *nats.Conn
	for i := 0; ; i++ {
		if nc, err = nats.Connect(fmt.Sprintf("nats://127.0.0.1:%d", port)); err == nil {
			break
		}
		if i == 50 {
			return err
		}
		time.Sleep(100 * time.Millisecond)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	fmt.Printf("nats-server %s, max payload %d, %d events a round, PublishBatch of %d\n", nc.ConnectedServerVersion(), nc.MaxPayload(), *n, *call)
	modes := map[string]stream.PublisherOption{
		"single": stream.WithMaxPayload(1), // every event alone
		"batch":  stream.WithMaxPayload(nc.MaxPayload()),
	}
	order := []string{"single", "batch"}
	sums := map[string]time.Duration{}
	for r := range *rounds {
		if r%2 == 1 {
			order[0], order[1] = order[1], order[0]
		}
		for _, mode := range order {
			cpu, msgs, err := round(js, srv.Process.Pid, fmt.Sprintf("NB_%d_%s", r, mode), *n, *call, modes[mode])
			if err != nil {
				return fmt.Errorf("round %d %s: %w", r, mode, err)
			}
			sums[mode] += cpu
			fmt.Printf("round %d %-6s %6d messages  nats-server %7.2f µs/event\n", r, mode, msgs, us(cpu, *n))
		}
	}
	for _, mode := range []string{"single", "batch"} {
		fmt.Printf("mean   %-6s nats-server %7.2f µs/event\n", mode, us(sums[mode], *n**rounds))
	}
	return nil
}

func us(d time.Duration, n int) float64 { return float64(d.Microseconds()) / float64(n) }

// round publishes and consumes n events on streams of its own and returns
// the server's CPU time over both and how many messages carried them.
func round(js jetstream.JetStream, pid int, name string, n, call int, opt stream.PublisherOption) (time.Duration, uint64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cfg := stream.Config{Stream: name, DLQStream: name + "_DLQ", SubjectPrefix: name, MaxAge: time.Hour, Duplicates: time.Minute, DLQMaxAge: time.Hour}
	if err := stream.Ensure(ctx, js, cfg); err != nil {
		return 0, 0, err
	}
	defer func() {
		_ = js.DeleteStream(context.Background(), cfg.Stream)
		_ = js.DeleteStream(context.Background(), cfg.DLQStream)
	}()
	cons, err := stream.EnsureConsumer(ctx, js, cfg, "bench")
	if err != nil {
		return 0, 0, err
	}
	pub := stream.NewPublisher(js, cfg, opt)
	evs := make([]events.Event, n)
	now := time.Now()
	for i := range evs {
		evs[i] = events.NewActual("bench", events.Actual{
			RequestID: fmt.Sprintf("%s-%d", name, i), Tenant: "acme", User: fmt.Sprintf("u-%d", i%1000),
			Endpoint: "/v1/chat", Model: "m", InputTokens: int64(i), OutputTokens: 7,
		}, now)
	}
	c0, err := proc.CPU(pid)
	if err != nil {
		return 0, 0, err
	}
	for i := 0; i < n; i += call {
		if err := pub.PublishBatch(ctx, evs[i:min(i+call, n)]); err != nil {
			return 0, 0, err
		}
	}
	handled := 0
	h := func(context.Context, events.Event) error { handled++; return nil }
	for handled < n {
		batch, err := cons.Fetch(500, jetstream.FetchMaxWait(time.Second))
		if err != nil {
			return 0, 0, err
		}
		for msg := range batch.Messages() {
			if err := stream.Process(ctx, js, cfg, msg, h); err != nil {
				return 0, 0, err
			}
		}
		if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, jetstream.ErrNoMessages) {
			return 0, 0, err
		}
	}
	c1, err := proc.CPU(pid)
	if err != nil {
		return 0, 0, err
	}
	s, err := js.Stream(ctx, cfg.Stream)
	if err != nil {
		return 0, 0, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return 0, 0, err
	}
	return c1 - c0, info.State.Msgs, nil
}
