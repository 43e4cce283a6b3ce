package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"quotaflow/internal/config"
	"quotaflow/internal/eviction"
	"quotaflow/internal/obs"
	"quotaflow/internal/pgdb"
	"quotaflow/internal/redisconn"
	"quotaflow/internal/server"
	"quotaflow/internal/service"
	"quotaflow/pkg/events/stream"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/repair"
	"quotaflow/services/accounter/internal/consume"
	"quotaflow/services/accounter/internal/effects"
	"quotaflow/services/accounter/internal/expire"
	"quotaflow/services/accounter/internal/ledger"
	"quotaflow/services/accounter/internal/rebuild"
	"quotaflow/services/accounter/internal/reconcile"
)

// source is the CloudEvents source of the corrected events.
const source = "quotaflow/accounter"

// Readiness components: /readyz turns 200 once the streams and consumer
// exist and the migrations ran.
const (
	readyStreams    = "nats_streams"
	readyMigrations = "postgres_migrations"
)

// hooks lets tests observe and steer run; nil in production.
type hooks struct {
	started   func(ops string)  // told the bound ops address
	beforeAck func(n int) error // consume.Options.BeforeAck
	registry  func(*prometheus.Registry)
}

// run wires the service, consumes until ctx ends, then shuts down in
// reverse order: stop fetching and finish the batches in flight, stop the
// periodic tasks, flush the corrections, drain NATS, close Redis and
// Postgres.
func run(ctx context.Context, cfg Config, log *slog.Logger, h *hooks) error {
	if h == nil {
		h = &hooks{}
	}
	reg := obs.NewRegistry()
	if h.registry != nil {
		h.registry(reg)
	}
	ready := obs.NewReadiness(readyStreams, readyMigrations)
	log.Info("starting",
		"ops_addr", cfg.OpsAddr, "pprof", cfg.Pprof, "policy_file", cfg.PolicyFile,
		"redis_url", config.Redacted(cfg.RedisURL), "postgres_url", config.Redacted(cfg.PostgresURL),
		"nats_url", config.Redacted(cfg.NATSURL), "stream", cfg.Stream, "subject_prefix", cfg.SubjectPrefix,
		"durable", cfg.Durable, "workers", cfg.Workers, "batch_size", cfg.BatchSize, "batch_wait", cfg.BatchWait.String(),
		"reservation_ttl", cfg.ReservationTTL.String(), "settle_expired_at_estimate", cfg.SettleExpiredAtEstimate,
		"reconcile_interval", cfg.ReconcileInterval.String(), "reconcile_repair", cfg.ReconcileRepair)

	ops, err := server.Listen(cfg.OpsAddr, "ops", obs.OpsHandler(reg, ready, cfg.Ops), log)
	if err != nil {
		return err
	}
	defer service.ShutdownStep(log, "ops server", cfg.ShutdownTimeout, ops.Shutdown)
	if h.started != nil {
		h.started(ops.Addr())
	}

	watcher, err := service.NewPolicyWatcher(cfg.PolicyFile, log)
	if err != nil {
		return err
	}
	var bg sync.WaitGroup
	bgCtx, bgCancel := context.WithCancel(context.Background())
	defer func() { bgCancel(); bg.Wait() }()
	bg.Go(func() { service.WatchPolicy(bgCtx, watcher, log) })

	// Postgres: create the database if absent, migrate; retried until it
	// answers, /readyz saying why meanwhile.
	pool, err := retry(ctx, log, ready, readyMigrations, func(ctx context.Context) (*pgxpool.Pool, error) {
		pool, err := pgdb.Open(ctx, cfg.PostgresURL, func(pc *pgxpool.Config) {
			// Each worker holds a connection for its batch's transaction;
			// a rebuild and a repair each hold a lock's connection and read
			// the ledger on another, and the expiry task needs one.
			pc.MaxConns = max(pc.MaxConns, int32(cfg.Workers)+5)
		})
		if err != nil {
			return nil, err
		}
		if err := ledger.Migrate(ctx, pool); err != nil {
			pool.Close()
			return nil, err
		}
		return pool, nil
	})
	if err != nil {
		return err
	}
	defer pool.Close()
	store := ledger.New(pool)

	rdb, err := redisconn.Open(cfg.RedisURL)
	if err != nil {
		return err
	}
	defer rdb.Close()
	rdb.AddHook(newRedisErrors(reg))
	evict := eviction.New(rdb, log)
	evict.Report(ready)
	bg.Go(func() { evict.Run(bgCtx, eviction.Interval) })
	opts := limits.Options{ReservationTTL: cfg.ReservationTTL}
	rep := repair.New(rdb, opts)
	app := effects.New(limits.New(rdb, opts), watcher.Current)
	rb := rebuild.New(rep, rdb, watcher.Current, store)
	expiry := expire.New(app, store, rb.Gate())

	nc, err := nats.Connect(cfg.NATSURL,
		nats.Name("quotaflow-accounter"),
		nats.MaxReconnects(-1),
		nats.RetryOnFailedConnect(true),
		nats.ReconnectWait(500*time.Millisecond),
		nats.DrainTimeout(cfg.ShutdownTimeout),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) { log.Warn("nats disconnected", "err", err) }),
		nats.ReconnectHandler(func(*nats.Conn) { log.Info("nats reconnected") }),
	)
	if err != nil {
		return fmt.Errorf("nats: %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return fmt.Errorf("jetstream: %w", err)
	}
	cons, err := retry(ctx, log, ready, readyStreams, func(ctx context.Context) (jetstream.Consumer, error) {
		if err := stream.Ensure(ctx, js, cfg.Config); err != nil {
			return nil, err
		}
		c, err := stream.EnsureConsumer(ctx, js, cfg.Config, cfg.Durable)
		if err != nil {
			return nil, err
		}
		return raiseMaxAckPending(ctx, js, c, cfg)
	})
	if err != nil {
		return err
	}
	var redisErr atomic.Pointer[string] // the last epoch check's failure
	ready.Watch("redis", func() (bool, string) {
		if e := redisErr.Load(); e != nil {
			return true, *e
		}
		return false, ""
	})

	epochs := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "quotaflow_accounter_rebuilds_total",
		Help: "Rebuilds of Redis from the ledger after it lost its data, by result (ok, error).",
	}, []string{"result"})
	expired := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "quotaflow_accounter_expired_reservations_total",
		Help: "Reservations settled by the expiry task because no actual event came before their TTL.",
	})
	driftTokens := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "quotaflow_accounter_drift_tokens",
		Help: "Weighted tokens by which Redis's token windows lie outside the ledger's usage, summed over subjects and limits, at the last reconciliation (reservations still in the stream count too).",
	})
	driftSubjects := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "quotaflow_accounter_drift_subjects",
		Help: "Subjects, and tenants for tenant-wide limits, whose Redis windows disagreed with the ledger at the last reconciliation.",
	})
	reconciled := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "quotaflow_accounter_reconciliations_total",
		Help: "Reconciliation passes of Redis's token windows against the ledger, by result (ok, error).",
	}, []string{"result"})
	repaired := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "quotaflow_accounter_repaired_tokens_total",
		Help: "Weighted tokens the reconciliation added to (raised) or took from (lowered) Redis's token windows to agree with the ledger.",
	}, []string{"direction"})
	epochs.WithLabelValues("ok")
	epochs.WithLabelValues("error")
	repaired.WithLabelValues("raised")
	repaired.WithLabelValues("lowered")
	reconciled.WithLabelValues("ok")
	reconciled.WithLabelValues("error")
	reg.MustRegister(epochs, expired, driftTokens, driftSubjects, repaired, reconciled)

	// The epoch first: consuming into a Redis that lost its data would only
	// nak (the scripts refuse without the epoch).
	checkEpoch := func(ctx context.Context) {
		cctx, cancel := context.WithTimeout(withRedisOp(ctx, opEpoch), 10*time.Minute)
		defer cancel()
		start := time.Now()
		rebuilt, subjects, err := rb.EnsureEpoch(cctx)
		if err == nil {
			redisErr.Store(nil)
		}
		switch {
		case err != nil:
			msg := "epoch check or rebuild failed: " + err.Error()
			redisErr.Store(&msg)
			epochs.WithLabelValues("error").Inc()
			log.Error("redis epoch check or rebuild failed; retrying", "err", err)
		case rebuilt:
			epochs.WithLabelValues("ok").Inc()
			log.Info("redis rebuilt from the ledger; epoch written", "subjects", subjects, "took", time.Since(start).String())
		}
	}
	checkEpoch(ctx)
	bg.Go(func() {
		service.Every(bgCtx, cfg.EpochInterval, checkEpoch)
	})
	bg.Go(func() {
		service.Every(bgCtx, cfg.ExpiryInterval, func(ctx context.Context) {
			n, err := expiry.Settle(withRedisOp(ctx, opExpiry), time.Now().Add(-cfg.ReservationTTL), cfg.SettleExpiredAtEstimate)
			expired.Add(float64(n))
			if err != nil {
				log.Error("settling expired reservations failed; retrying", "err", err)
			} else if n > 0 {
				log.Info("settled expired reservations", "count", n, "at_estimate", cfg.SettleExpiredAtEstimate)
			}
		})
	})

	if cfg.ReconcileInterval > 0 {
		rec := reconcile.New(rep, rdb, watcher.Current, store, reconcile.ConsumerBacklog{Consumer: cons}, rb.Gate(), cfg.ReconcileRepair, log)
		bg.Go(func() {
			service.Every(bgCtx, cfg.ReconcileInterval, func(ctx context.Context) {
				d, err := rec.Reconcile(withRedisOp(ctx, opReconcile))
				repaired.WithLabelValues("raised").Add(float64(d.Raised))
				repaired.WithLabelValues("lowered").Add(float64(d.Lowered))
				if err != nil {
					reconciled.WithLabelValues("error").Inc()
					log.Error("reconciling redis with the ledger failed", "err", err)
					return
				}
				reconciled.WithLabelValues("ok").Inc()
				driftTokens.Set(float64(d.Tokens))
				driftSubjects.Set(float64(d.Drifted))
				if d.Drifted > 0 {
					log.Warn("redis drifts from the ledger", "subjects", d.Subjects, "drifted", d.Drifted, "tokens", d.Tokens,
						"repaired_limits", d.Repaired, "raised", d.Raised, "lowered", d.Lowered, "held_in_flight", d.Held)
				}
			})
		})
	}

	pub := stream.NewPublisher(js, cfg.Config)
	consumer, err := consume.New(cons, js, store, app, rb.Gate(), pub, consume.Options{
		Events: cfg.Config, Workers: cfg.Workers, BatchSize: cfg.BatchSize, BatchWait: cfg.BatchWait,
		Source: source, BeforeAck: h.beforeAck,
	}, log, reg)
	if err != nil {
		return err
	}
	log.Info("consuming", "stream", cfg.Stream, "durable", cfg.Durable)
	consumer.Run(withRedisOp(ctx, opConsume)) // until ctx ends; waits for the batches in flight

	log.Info("shutting down")
	ready.Drain()
	bgCancel()
	bg.Wait()
	service.ShutdownStep(log, "publisher", cfg.ShutdownTimeout, pub.Flush)
	service.ShutdownStep(log, "nats", cfg.ShutdownTimeout, func(ctx context.Context) error { return service.DrainNATS(ctx, nc) })
	return nil
}

// raiseMaxAckPending lets the durable hold every worker's batch in flight
// twice over: the server's default of 1000 unacknowledged messages would
// otherwise starve workers whose fetches exceed it together. It only ever
// raises the limit, so instances with smaller settings keep the larger one.
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

// retry calls f until it succeeds or ctx ends, marking component ready on
// success and recording why it waits meanwhile.
func retry[T any](ctx context.Context, log *slog.Logger, ready *obs.Readiness, component string, f func(context.Context) (T, error)) (T, error) {
	wait := 100 * time.Millisecond
	for {
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		v, err := f(cctx)
		cancel()
		if err == nil {
			ready.Ready(component)
			return v, nil
		}
		ready.Waiting(component, err.Error())
		log.Warn("start-up step failed; retrying", "step", component, "err", err, "retry_in", wait.String())
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			var zero T
			return zero, errors.Join(fmt.Errorf("%s: %w", component, ctx.Err()), err)
		case <-t.C:
		}
		wait = min(2*wait, 5*time.Second)
	}
}
