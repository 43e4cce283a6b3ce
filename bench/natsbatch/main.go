// Command natsbatch measures what nats-server spends per message and per
// byte of events published and consumed (issue 13): on a private
// nats-server, in interleaved rounds, -n events published with
// stream.Publisher.PublishBatch in calls of -per events (each call is one
// message: 1 is a single CloudEvent, how every event travelled before
// batches) and consumed with stream.Process by -consumers durable
// consumers, reading the server's CPU from /proc around each. Events are
// actual events (-limits 0, ~300 bytes) or reserved events with that many
// limit snapshots (5: ~1.2 kB, admission's), so that the server's cost
// splits into a part per message and a part per byte; batches go
// compressed or not (-s2, stream.WithCompression).
//
//	go run ./bench/natsbatch -n 20000 -per 1,10,100 -limits 0,5 -s2 false,true -rounds 3
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/bench/internal/load"
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
	perList := flag.String("per", "1,100", "events per message (per PublishBatch call), comma-separated")
	limitsList := flag.String("limits", "0", "limit snapshots per event, comma-separated: 0 = actual events, else reserved events")
	s2List := flag.String("s2", "false,true", "compress batches (stream.WithCompression), comma-separated")
	consumers := flag.Int("consumers", 1, "durable consumers, each consuming every event (the pipeline has 2)")
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
	pers, err := load.Ints(*perList, 1)
	if err != nil {
		return fmt.Errorf("-per: %w", err)
	}
	lims, err := load.Ints(*limitsList, 0)
	if err != nil {
		return fmt.Errorf("-limits: %w", err)
	}
	var s2s []bool
	for _, f := range strings.Split(*s2List, ",") {
		b, err := strconv.ParseBool(strings.TrimSpace(f))
		if err != nil {
			return fmt.Errorf("-s2: %w", err)
		}
		s2s = append(s2s, b)
	}
	var modes []mode
	for _, l := range lims {
		for _, p := range pers {
			if p < 1 || l < 0 {
				return errors.New("-per must be positive, -limits not negative")
			}
			for _, c := range s2s {
				if p == 1 && c && len(s2s) > 1 {
					continue // a single event is never compressed
				}
				modes = append(modes, mode{per: p, limits: l, s2: c})
			}
		}
	}
	fmt.Printf("nats-server %s, max payload %d, %d events a round, %d consumers\n", nc.ConnectedServerVersion(), nc.MaxPayload(), *n, *consumers)
	res := make([][]result, len(modes))
	for r := range *rounds {
		for k := range modes {
			i := k
			if r%2 == 1 { // the other order every other round
				i = len(modes) - 1 - k
			}
			m := modes[i]
			got, err := round(js, srv.Process.Pid, fmt.Sprintf("NB_%d_%d", r, i), *n, *consumers, m, nc.MaxPayload())
			if err != nil {
				return fmt.Errorf("round %d %v: %w", r, m, err)
			}
			res[i] = append(res[i], got)
			fmt.Printf("round %d %v: %d messages of %d B, nats-server %.2f µs/event, %.1f µs/message\n",
				r, m, got.msgs, got.bytes/max(1, got.msgs), got.perEvent(*n), got.perMsg())
		}
	}
	fmt.Println("\nmedians: events/message, bytes/message, nats-server µs per event, per message, per kB")
	for i, m := range modes {
		r := res[i]
		med := func(f func(result) float64) float64 {
			v := make([]float64, len(r))
			for j := range r {
				v[j] = f(r[j])
			}
			slices.Sort(v)
			return v[len(v)/2]
		}
		fmt.Printf("%v  %6d B  %8.2f µs/event  %8.1f µs/message  %6.2f µs/kB\n", m, r[0].bytes/max(1, r[0].msgs),
			med(func(x result) float64 { return x.perEvent(*n) }), med(result.perMsg),
			med(func(x result) float64 { return x.perMsg() * 1000 / float64(max(1, x.bytes/x.msgs)) }))
	}
	return nil
}

// mode is how a round's events travel.
type mode struct {
	per, limits int
	s2          bool
}

func (m mode) String() string { return fmt.Sprintf("per %4d limits %d s2 %-5v", m.per, m.limits, m.s2) }

// result is a round's server CPU and what its stream stored.
type result struct {
	cpu         time.Duration
	msgs, bytes uint64
}

func (r result) perEvent(n int) float64 { return float64(r.cpu.Microseconds()) / float64(n) }
func (r result) perMsg() float64        { return float64(r.cpu.Microseconds()) / float64(max(1, r.msgs)) }

// round publishes n events and consumes them with each of the consumers,
// on streams of its own, and returns the server's CPU time over both and
// the messages and bytes that carried them.
func round(js jetstream.JetStream, pid int, name string, n, consumers int, m mode, maxPayload int64) (result, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cfg := stream.Config{Stream: name, DLQStream: name + "_DLQ", SubjectPrefix: name, MaxAge: time.Hour, Duplicates: time.Minute, DLQMaxAge: time.Hour}
	if err := stream.Ensure(ctx, js, cfg); err != nil {
		return result{}, err
	}
	defer func() {
		_ = js.DeleteStream(context.Background(), cfg.Stream)
		_ = js.DeleteStream(context.Background(), cfg.DLQStream)
	}()
	var conss []jetstream.Consumer
	for c := range consumers {
		cons, err := stream.EnsureConsumer(ctx, js, cfg, fmt.Sprint("bench", c))
		if err != nil {
			return result{}, err
		}
		conss = append(conss, cons)
	}
	pub := stream.NewPublisher(js, cfg, stream.WithMaxPayload(maxPayload), stream.WithCompression(m.s2))
	evs := make([]events.Event, n)
	now := time.Now()
	for i := range evs {
		evs[i] = event(name, i, m.limits, now)
	}
	c0, err := proc.CPU(pid)
	if err != nil {
		return result{}, err
	}
	for i := 0; i < n; i += m.per {
		if err := pub.PublishBatch(ctx, evs[i:min(i+m.per, n)]); err != nil {
			return result{}, err
		}
	}
	for _, cons := range conss {
		if err := consume(ctx, js, cfg, cons, n); err != nil {
			return result{}, err
		}
	}
	c1, err := proc.CPU(pid)
	if err != nil {
		return result{}, err
	}
	s, err := js.Stream(ctx, cfg.Stream)
	if err != nil {
		return result{}, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return result{}, err
	}
	return result{cpu: c1 - c0, msgs: info.State.Msgs, bytes: info.State.Bytes}, nil
}

// consume handles n events of cons, fetching as the services do.
func consume(ctx context.Context, js jetstream.JetStream, cfg stream.Config, cons jetstream.Consumer, n int) error {
	handled := 0
	h := func(context.Context, events.Event) error { handled++; return nil }
	for handled < n {
		batch, err := cons.Fetch(500, jetstream.FetchMaxWait(time.Second), jetstream.FetchMaxBytes(stream.FetchMaxBytes))
		if err != nil {
			return err
		}
		for msg := range batch.Messages() {
			if err := stream.Process(ctx, js, cfg, msg, h); err != nil {
				return err
			}
		}
		if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, jetstream.ErrNoMessages) {
			return err
		}
	}
	return nil
}

// event is event i of a round: an actual event, or a reserved event with
// limits snapshots like admission's.
func event(name string, i, limits int, now time.Time) events.Event {
	rid, user := fmt.Sprintf("%s-%d", name, i), fmt.Sprintf("u-%d", i%1000)
	if limits == 0 {
		return events.NewActual("bench", events.Actual{
			RequestID: rid, Tenant: "acme", User: user,
			Endpoint: "/v1/chat", Model: "gpt-4o-mini", InputTokens: int64(i), OutputTokens: 7,
		}, now)
	}
	d := events.Reserved{
		RequestID: rid, Tenant: "acme", User: user, Plan: "pro", Endpoint: "/v1/chat", Model: "gpt-4o-mini",
		IP: "203.0.113.7", EstimatedTokens: 1200, ExpiresAt: now.Add(time.Hour), Version: int64(i + 1),
	}
	for l := range limits {
		d.Limits = append(d.Limits, events.LimitState{
			Scope: "user", Name: fmt.Sprint("tokens-", l), Unit: "tokens",
			Limit: 1_000_000, Used: int64(i * 1200), Remaining: 1_000_000 - int64(i*1200)%1_000_000, ResetSeconds: 3600,
		})
	}
	return events.NewReserved("bench", d, now)
}
