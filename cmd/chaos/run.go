package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/internal/e2e"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

// Config is one chaos run; the test uses a shortened one.
type Config struct {
	// Down is how long each killed server or service stays down.
	Down time.Duration
	// Gap is the steady load before the first fault and after each
	// recovery.
	Gap time.Duration
	// Rate is each simulated user's requests per second.
	Rate float64
	// Settle bounds the wait for the ledger and the alerts at the end,
	// and for the pipeline's recovery after each fault.
	Settle time.Duration
	// Cluster runs the clustered shape (e2e.PrivateConfig.Cluster) and
	// its faults.
	Cluster bool
}

func defaultConfig() Config {
	return Config{Down: 5 * time.Second, Gap: 10 * time.Second, Rate: 5, Settle: 90 * time.Second}
}

// faults of the run, in the order they are injected: a cluster run kills
// one node or instance of each clustered kind, the others keep serving.
func (cfg Config) faults() []string {
	if cfg.Cluster {
		return []string{"redis master", "nats node", "admission", "accounter"}
	}
	return []string{"redis", "nats", "postgres", "accounter", "alerter"}
}

// stack is what one run started: the private pipeline and the webhook
// receiver.
type stack struct {
	*e2e.Private
	recv  *e2e.Receiver
	token string
	stats *e2e.Stats // the traffic's, once it runs
	cfg   Config
	out   io.Writer
	// failoverTook is how long the killed Redis master's slots went
	// unserved (a cluster run).
	failoverTook time.Duration
	allows       allowLog        // a cluster run's allowed admits
	loss         replicationLoss // what the failover lost of them
	// admissionKilled is when the first admission instance (st.API) was
	// gone, in a cluster run.
	admissionKilled time.Time
}

// close stops the pipeline, then the receiver.
func (s *stack) close() {
	if s.Private != nil {
		s.Private.Close()
	}
	if s.recv != nil {
		s.recv.Close()
	}
}

// run starts everything, plays steady traffic while injecting the faults
// one at a time, then checks what is left.
func run(ctx context.Context, cfg Config, out io.Writer) (*Report, error) {
	st, err := startStack(ctx, cfg, out)
	if st != nil {
		defer st.close()
	}
	if err != nil {
		return nil, err
	}
	// The LLM service publishes its actual usage to JetStream itself, as
	// services do (admission's POST /v1/usage is for those that cannot,
	// and answers 503 while NATS is down, by contract).
	nc, err := nats.Connect(st.NATSURL, nats.Name("quotaflow-chaos-llm"),
		nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		return nil, err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, err
	}
	pub := stream.NewPublisher(js, stream.Config{})
	rep := &Report{Stats: e2e.NewStats()}
	st.stats = rep.Stats
	rec := &recorder{}
	gen := &e2e.Generator{
		Base: st.API, Peers: st.APIs[1:], Token: st.token, Endpoint: endpoint, Run: "chaos", St: rep.Stats,
		Client:   &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 64}},
		Patience: 2 * cfg.Settle, // a report outlives any outage of the run
		Latency:  rec.observe,
		Publish: func(ctx context.Context, ev events.Event) error {
			ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			defer cancel()
			return pub.Publish(ctx, ev)
		},
	}
	if cfg.Cluster {
		gen.OnAllow = st.allows.add
	}
	loadCtx, stopLoad := context.WithCancel(ctx)
	defer stopLoad()
	played := make(chan struct{})
	us := cfg.users()
	// Play paces rounds over a duration; the faults end the load, so it is
	// given far more rounds than it will play.
	go func() {
		span := time.Hour
		gen.Play(loadCtx, us, int(cfg.Rate*span.Seconds()), span)
		close(played)
	}()

	fmt.Fprintf(out, "steady load: %d users, %.0f requests/s in all\n", len(us), cfg.Rate*float64(len(us)))
	if err := st.phase(ctx, out, rec, "steady", cfg.Gap, nil); err != nil {
		return rep, err
	}
	if cfg.Cluster {
		detail, err := st.tenantsSpread(ctx, cfg)
		if err != nil {
			return rep, err
		}
		fmt.Fprintln(out, detail)
	}
	for _, f := range cfg.faults() {
		if err := st.phase(ctx, out, rec, f, cfg.Settle, st.inject(f, cfg.Down)); err != nil {
			return rep, err
		}
		if err := st.phase(ctx, out, rec, "after "+f, cfg.Gap, nil); err != nil {
			return rep, err
		}
	}
	stopLoad()
	fmt.Fprintln(out, "load stopped; waiting for the reports in flight, the ledger and the alerts ...")
	<-played
	rep.Phases = rec.phases
	rep.Checks = st.check(context.WithoutCancel(ctx), cfg, rep.Stats)
	printReport(out, rep)
	return rep, nil
}

// startStack starts the receiver and the private pipeline, waiting until
// admission decides from Redis.
func startStack(ctx context.Context, cfg Config, out io.Writer) (*stack, error) {
	st := &stack{token: "chaos-" + e2e.RandomHex(16), cfg: cfg, out: out}
	secret := e2e.NewWebhookSecret()
	var err error
	if st.recv, err = e2e.NewReceiver(secret, io.Discard); err != nil {
		return st, err
	}
	st.Private, err = e2e.StartPrivate(ctx, e2e.PrivateConfig{
		Name: "chaos", Policy: chaosPolicy(cfg), Token: st.token, Out: out, Cluster: cfg.Cluster,
		Webhooks: e2e.Webhooks("chaos-receiver", st.recv.URL, secret),
		Env: []string{"QF_LOG_LEVEL=info", "QF_SHUTDOWN_TIMEOUT=5s",
			// A killed consumer's unacknowledged batch comes back after this.
			"QF_ACK_WAIT=5s"},
		AccounterEnv: []string{"QF_EPOCH_INTERVAL=1s"},
		AlerterEnv:   []string{"QF_CONSUMER=alerter", "QF_DELIVERY_POLL=500ms"},
		// Two loaded cores answer Redis in more than the default 10 ms at
		// times; the run wants Redis's exact decisions between faults.
		AdmissionEnv: []string{"QF_REDIS_TIMEOUT=100ms"},
	})
	return st, err
}

// inject returns the fault called name: the process killed, down for
// down, and started again.
func (st *stack) inject(name string, down time.Duration) func(context.Context) error {
	pause := func(ctx context.Context) {
		select {
		case <-ctx.Done():
		case <-time.After(down):
		}
	}
	server := func(s *e2e.Server, crash func()) func(context.Context) error {
		return func(ctx context.Context) error {
			crash()
			pause(ctx)
			return s.Up(ctx)
		}
	}
	service := func(s *e2e.Service) func(context.Context) error {
		return func(ctx context.Context) error {
			s.Kill()
			pause(ctx)
			return s.Restart()
		}
	}
	switch name {
	case "redis": // no persistence: back empty, as after a failover to an empty replica
		return server(st.Redis, st.Redis.Kill)
	case "nats": // JetStream's file store survives
		return server(st.NATS, st.NATS.Kill)
	case "postgres": // immediate shutdown: crash recovery at the next start
		return server(st.Postgres, func() { _ = st.Postgres.Signal(syscall.SIGQUIT, 10*time.Second) })
	case "accounter":
		return service(st.Accounter)
	case "alerter":
		return service(st.Alerter)
	case "redis master": // its replica takes over; it comes back as a replica
		return func(ctx context.Context) error { return st.failover(ctx, down) }
	case "nats node": // the R3 streams go on on the other two
		return server(st.NATSNodes[0], st.NATSNodes[0].Kill)
	default: // one admission instance: the gateway sends to the other
		return func(ctx context.Context) error {
			st.Admission.Kill()
			// Every answer it gave came before this.
			st.admissionKilled = time.Now()
			pause(ctx)
			return st.Admission.Restart()
		}
	}
}

// phase runs one phase: the fault (if any), then waits until every
// service is ready and steady again (its recovery), or simply waits d for
// a steady phase.
func (st *stack) phase(ctx context.Context, out io.Writer, rec *recorder, name string, d time.Duration, fault func(context.Context) error) error {
	p := rec.begin(name, st.failopen(ctx))
	defer func() { rec.end(p, st.failopen(ctx)) }()
	if fault == nil {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(d):
			return nil
		}
	}
	fmt.Fprintf(out, "[%s] %s: killed, down ...\n", time.Now().Format("15:04:05"), name)
	if err := fault(ctx); err != nil {
		return fmt.Errorf("restart %s: %w", name, err)
	}
	up, sent := time.Now(), st.stats.ActualEvents.Load()
	for _, s := range st.Services() {
		if deg := s.WaitSteady(ctx, d); deg != "" {
			return fmt.Errorf("after the %s fault %s did not recover within %v: %s; log:\n%s", name, s.Name, d, deg, e2e.Tail(s.LogPath, 20))
		}
	}
	p.recovery = time.Since(up)
	// The ledger has caught up once it holds every actual event accepted
	// before the restart.
	for {
		l, err := e2e.ReadLedger(ctx, st.DBURL)
		if err == nil && l.ActualCount >= sent {
			break
		}
		if time.Since(up) > d {
			return fmt.Errorf("after the %s fault the ledger did not catch up within %v (%v)", name, d, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	p.caughtUp = time.Since(up)
	fmt.Fprintf(out, "[%s] %s: back; services steady after %.1fs, ledger caught up after %.1fs\n",
		time.Now().Format("15:04:05"), name, p.recovery.Seconds(), p.caughtUp.Seconds())
	return nil
}

// failopen is each admission instance's count of decisions made without
// Redis since it started (0 while it is down).
func (st *stack) failopen(ctx context.Context) []float64 {
	ns := make([]float64, len(st.Admissions))
	for i, a := range st.Admissions {
		ds, err := e2e.Decisions(ctx, a.Ops)
		if err != nil {
			continue
		}
		for _, d := range ds {
			if d.Result == "failopen" {
				ns[i] += d.Count
			}
		}
	}
	return ns
}
