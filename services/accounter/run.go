package main

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"quotaflow/internal/alertlog"
	"quotaflow/internal/obs"
	"quotaflow/internal/pgdb"
	"quotaflow/internal/service"
	"quotaflow/pkg/events/stream"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/repair"
	"quotaflow/services/accounter/internal/console"
	"quotaflow/services/accounter/internal/consume"
	"quotaflow/services/accounter/internal/effects"
	"quotaflow/services/accounter/internal/expire"
	"quotaflow/services/accounter/internal/history"
	"quotaflow/services/accounter/internal/ledger"
	"quotaflow/services/accounter/internal/rebuild"
	"quotaflow/services/accounter/internal/reconcile"
	"quotaflow/services/accounter/internal/retention"
)

// source is the CloudEvents source of the corrected events.
const source = "quotaflow/accounter"

// partitionInterval is how often the ledger's partitions are created
// ahead and dropped past the retention: well inside ledger.AheadDays, and
// a drop is at most an hour late. A failed run is tried again after
// partitionRetry.
const (
	partitionInterval = time.Hour
	partitionRetry    = 2 * time.Minute
)

// Readiness components: /readyz turns 200 once the streams and consumer
// exist, the migrations ran, the console's pool is open and the first
// epoch check is done (admission decides locally until Redis holds the
// epoch; a failed check shows as Redis degraded).
const (
	readyStreams    = "nats_streams"
	readyMigrations = "postgres_migrations"
	readyConsoleDB  = "postgres_console"
	readyEpoch      = "redis_epoch"
)

// hooks lets tests observe and steer run; main passes none.
type hooks struct {
	started   func(ops string, reg *prometheus.Registry) // told the bound ops address (tests listen on port 0) and the metrics
	console   func(addr string)                          // told the console's bound address
	beforeAck func(n int) error                          // consume.Options.BeforeAck
}

// run wires the accounter and consumes until ctx ends, finishing the
// batches in flight; then the stack stops what it started in reverse: the
// periodic jobs, the corrections flushed, NATS drained, Redis, Postgres,
// the ops server. Stopped while it waits for Postgres or NATS, it returns
// nil.
func run(ctx context.Context, cfg Config, log *slog.Logger, h hooks) error {
	reg, ready := obs.NewRegistry(), obs.NewReadiness(readyStreams, readyMigrations, readyConsoleDB, readyEpoch)
	stack := service.NewStack(log, cfg.ShutdownTimeout, ready)
	defer stack.Close()
	ops, err := service.Listen(stack, "ops", cfg.OpsAddr, obs.OpsHandler(reg, ready, cfg.Ops))
	if err != nil {
		return err
	}
	if h.started != nil {
		h.started(ops.Addr(), reg)
	}
	watcher, err := service.WatchPolicy(stack, cfg.PolicyFile, log)
	if err != nil {
		return err
	}
	pool, ok := service.Open(ctx, stack, readyMigrations, "postgres", pgdb.Connect(cfg.PostgresURL, ledger.Migrate, log, cfg.poolSize), (*pgxpool.Pool).Close)
	if !ok {
		return nil
	}
	// The console reads on a pool of its own: however many reads a token
	// keeps in flight, they never take a connection of the ledger's writers.
	reads, ok := service.Open(ctx, stack, readyConsoleDB, "console postgres", pgdb.Connect(cfg.PostgresURL, nil, log, cfg.consolePool().Configure), (*pgxpool.Pool).Close)
	if !ok {
		return nil
	}
	store := ledger.New(pool)
	rdb, err := service.OpenRedis(stack, cfg.RedisURL, newRedisErrors(reg))
	if err != nil {
		return err
	}
	lim := limits.New(rdb, cfg.limitsOptions())
	stack.Go("engines", func(ctx context.Context) { service.DropOtherEngines(ctx, lim, log) })
	console, err := startConsole(stack, cfg, log, history.NewReader(reads, cfg.ConsoleQueryTimeout, history.WindowsSource{Limiter: lim, Policy: watcher.Current}))
	if err != nil {
		return err
	}
	if h.console != nil {
		h.console(console)
	}
	rep := repair.New(rdb, cfg.limitsOptions())
	app := effects.New(lim, watcher.Current)
	rb, err := rebuild.New(rep, rdb, watcher.Current, store, log, reg)
	if err != nil {
		return err
	}
	ready.Watch("redis", rb.Degraded)
	nc, js, err := service.ConnectNATS(stack, "accounter", cfg.NATSURL)
	if err != nil {
		return err
	}
	// Batches of corrections fit the server's max payload (0 until the
	// first connection: the Publisher's default).
	pub := stream.NewPublisher(js, cfg.Config, stream.WithMaxPayload(nc.MaxPayload()))
	stack.Push("publisher", pub.Flush)
	cons, ok := service.Retry(ctx, log, ready, readyStreams, ensureConsumer(js, cfg))
	if !ok {
		return nil
	}
	expiry, err := expire.New(app, store, rb.Gate(), cfg.expireOptions(), log, reg)
	if err != nil {
		return err
	}
	rec, err := reconcile.New(rep, rdb, watcher.Current, store, reconcile.ConsumerBacklog{Consumer: cons}, rb.Gate(), cfg.ReconcileRepair, log, reg)
	if err != nil {
		return err
	}
	keeper, err := retention.New(store, watcher.Current, cfg.retentionOptions(), log, reg)
	if err != nil {
		return err
	}
	failed := keeper.Keep(ctx) // before consuming: today's partition, whatever the last run left
	stack.Go("partitions", func(ctx context.Context) { keeper.Run(ctx, failed, partitionInterval, partitionRetry) })
	rb.Check(withRedisOp(ctx, opEpoch)) // before consuming: without its epoch Redis refuses every event
	ready.Ready(readyEpoch)
	stack.Go("epoch check", every(cfg.EpochInterval, opEpoch, rb.Check))
	stack.Go("expiry", every(cfg.ExpiryInterval, opExpiry, expiry.Expire))
	stack.Go("reconciliation", every(cfg.ReconcileInterval, opReconcile, rec.Check))
	consumer, err := consume.New(cons, js, store, app, rb.Gate(), pub, cfg.consumeOptions(h.beforeAck), log, reg)
	if err != nil {
		return err
	}
	consumer.Run(withRedisOp(ctx, opConsume)) // until ctx ends; waits for the batches in flight
	return nil
}

// startConsole authenticates with admission's tokens and serves the
// console on cfg.ConsoleAddr, on loopback only when no token is configured
// (a warning says so). Its alerts come from the alerter's API when
// QF_ALERTER_URL is set. It returns the bound address.
func startConsole(stack *service.Stack, cfg Config, log *slog.Logger, rd *history.Reader) (string, error) {
	tokens, err := service.OpenTokens(stack, cfg.Tokens, log)
	if err != nil {
		return "", err
	}
	var alerts history.AlertSource = rd
	if cfg.AlerterURL != "" {
		c, err := alertlog.NewClient(cfg.AlerterURL, cfg.AlerterTimeout)
		if err != nil {
			return "", fmt.Errorf("QF_ALERTER_URL: %w", err)
		}
		alerts = history.Alerter{Client: c}
	}
	srv, err := service.ListenAPI(stack, "console", "console_addr", cfg.ConsoleAddr, tokens, history.NewHandler(history.Options{
		Reader: rd, Alerts: alerts, Auth: tokens, Log: log,
		Pages: console.New(console.Options{Auth: tokens, Source: consoleSource{rd, alerts}, Log: log}),
	}))
	if err != nil {
		return "", err
	}
	return srv.Addr(), nil
}

// every returns a job for Stack.Go that calls f every d (never when d is
// 0) until the stack stops it, with f's Redis errors counted under op.
func every(d time.Duration, op string, f func(context.Context)) func(context.Context) {
	return func(ctx context.Context) {
		if d > 0 {
			service.Every(withRedisOp(ctx, op), d, f)
		}
	}
}

// ensureConsumer returns the start-up step that ensures the streams and
// the accounter's durable consumer, for service.Retry.
func ensureConsumer(js jetstream.JetStream, cfg Config) func(context.Context) (jetstream.Consumer, error) {
	return func(ctx context.Context) (jetstream.Consumer, error) {
		if err := stream.Ensure(ctx, js, cfg.Config); err != nil {
			return nil, err
		}
		c, err := stream.EnsureConsumer(ctx, js, cfg.Config, cfg.Durable)
		if err != nil {
			return nil, err
		}
		return raiseMaxAckPending(ctx, js, c, cfg)
	}
}

// raiseMaxAckPending lets the durable hold every worker's batch in flight
// twice over (a fetch takes up to BatchSize messages, and its runs wait
// for the workers): the server's default of 1000 unacknowledged messages
// could otherwise hold a fetch back while runs wait. It only ever raises
// the limit, so instances with smaller settings keep the larger one.
func raiseMaxAckPending(ctx context.Context, js jetstream.StreamConsumerManager, c jetstream.Consumer, cfg Config) (jetstream.Consumer, error) {
	info, err := c.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("consumer info: %w", err)
	}
	want := 2 * cfg.Workers * cfg.BatchSize
	if info.Config.MaxAckPending >= want {
		return c, nil
	}
	cc := info.Config
	cc.MaxAckPending = want
	c, err = js.CreateOrUpdateConsumer(ctx, cfg.Stream, cc)
	if err != nil {
		return nil, fmt.Errorf("raise max ack pending of %s: %w", cfg.Durable, err)
	}
	return c, nil
}
