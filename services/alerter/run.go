package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/internal/obs"
	"quotaflow/internal/pgdb"
	"quotaflow/internal/server"
	"quotaflow/internal/service"
	"quotaflow/pkg/events"
	"quotaflow/services/alerter/internal/deliver"
	"quotaflow/services/alerter/internal/detect"
	"quotaflow/services/alerter/internal/store"
)

// Readiness components: /readyz is 503 until both are ready.
const (
	readyPostgres = "postgres"
	readyConsumer = "nats_consumer"
)

// run wires the service, serves until ctx ends, then shuts down in reverse
// order: stop consuming, stop detection and delivery (attempts in flight
// are retried after their lease), drain NATS, close Postgres. started,
// when not nil, is told the bound ops address (tests listen on port 0).
func run(ctx context.Context, cfg Config, log *slog.Logger, started func(ops string)) error {
	reg := obs.NewRegistry()
	ready := obs.NewReadiness(readyPostgres, readyConsumer)
	log.Info("starting",
		"ops_addr", cfg.OpsAddr, "postgres_url", redacted(cfg.PostgresURL), "nats_url", redacted(cfg.NATSURL), "stream", cfg.Stream,
		"subject_prefix", cfg.SubjectPrefix, "consumer", cfg.Consumer, "webhooks_file", cfg.WebhooksFile)

	hooks, err := deliver.Load(cfg.WebhooksFile, detect.Kinds)
	if err != nil {
		return err
	}
	if len(hooks) == 0 {
		log.Warn("no webhooks configured: alerts are detected and counted but not sent")
	}

	ops, err := server.Listen(cfg.OpsAddr, "ops", obs.OpsHandler(reg, ready), log)
	if err != nil {
		return err
	}
	defer service.ShutdownStep(log, "ops server", cfg.ShutdownTimeout, ops.Shutdown)
	if started != nil {
		started(ops.Addr())
	}

	pool, err := pgdb.Open(ctx, cfg.PostgresURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := store.Migrate(ctx, pool); err != nil {
		return err
	}
	ready.Ready(readyPostgres)
	st := store.New(pool)

	dl, err := deliver.New(st, hooks, deliver.Options{
		AttemptTimeout: cfg.DeliveryTimeout, MinBackoff: cfg.DeliveryMinBackoff, MaxBackoff: cfg.DeliveryMaxBackoff,
		MaxAge: cfg.DeliveryMaxAge, Poll: cfg.DeliveryPoll,
	}, log, reg)
	if err != nil {
		return err
	}
	det, err := detect.New(st, deliver.Route(hooks), detect.Options{
		Hysteresis: cfg.Hysteresis, SpikeWindow: cfg.SpikeWindow, SpikeRate: cfg.SpikeRate,
		SpikeMinRequests: cfg.SpikeMinRequests, AbuseWindow: cfg.AbuseWindow, AbuseBurst: cfg.AbuseBurst,
	}, log, reg, dl.Notify)
	if err != nil {
		return err
	}
	if err := det.Load(ctx); err != nil {
		return err
	}

	var bg sync.WaitGroup
	bgCtx, bgCancel := context.WithCancel(context.Background())
	defer func() { bgCancel(); bg.Wait() }()
	bg.Go(func() { dl.Run(bgCtx) })
	bg.Go(func() { det.Run(bgCtx, cfg.EvalInterval) })

	nc, err := nats.Connect(cfg.NATSURL,
		nats.Name("quotaflow-alerter"),
		nats.MaxReconnects(-1),
		nats.RetryOnFailedConnect(true),
		nats.DrainTimeout(cfg.ShutdownTimeout),
	)
	if err != nil {
		return fmt.Errorf("nats connect: %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	handlers := events.Handlers{Reserved: det.Reserved, Corrected: det.Corrected, Denied: det.Denied}
	var consumer sync.WaitGroup
	cctx, ccancel := context.WithCancel(ctx)
	defer ccancel()
	consumer.Go(func() { consume(cctx, js, cfg, handlers.Dispatch, ready, log) })

	<-ctx.Done()
	log.Info("shutting down")
	ready.Drain()
	ccancel()
	consumer.Wait()
	bgCancel()
	bg.Wait()
	service.ShutdownStep(log, "nats", cfg.ShutdownTimeout, func(ctx context.Context) error { return service.DrainNATS(ctx, nc) })
	return nil
}

// consume ensures the streams and the durable consumer (retrying while
// NATS is unavailable), marks the service ready, then processes events
// until ctx ends.
func consume(ctx context.Context, js jetstream.JetStream, cfg Config, handle events.Handler, ready *obs.Readiness, log *slog.Logger) {
	log = log.With("component", "consume")
	var cons jetstream.Consumer
	retry(ctx, log, ready, func(ctx context.Context) error {
		if err := events.EnsureStreams(ctx, js, cfg.Config); err != nil {
			return err
		}
		c, err := events.EnsureConsumer(ctx, js, cfg.Config, cfg.Consumer)
		cons = c
		return err
	})
	if ctx.Err() != nil {
		return
	}
	ready.Ready(readyConsumer)
	log.Info("consuming", "stream", cfg.Stream, "consumer", cfg.Consumer)
	for ctx.Err() == nil {
		it, err := cons.Messages(jetstream.PullMaxMessages(64))
		if err != nil {
			log.Warn("open message iterator; retrying", "err", err)
			sleep(ctx, time.Second)
			continue
		}
		stop := context.AfterFunc(ctx, it.Stop)
		for {
			msg, err := it.Next()
			if err != nil {
				if !errors.Is(err, jetstream.ErrMsgIteratorClosed) {
					log.Warn("fetch events", "err", err)
				}
				break
			}
			if err := events.Process(ctx, js, cfg.Config, msg, handle); err != nil && ctx.Err() == nil {
				log.Warn("event not processed", "subject", msg.Subject(), "err", err)
			}
		}
		stop()
		it.Stop()
	}
}

// retry calls f until it succeeds or ctx ends, backing off up to 5 s and
// reporting why the consumer is not ready.
func retry(ctx context.Context, log *slog.Logger, ready *obs.Readiness, f func(context.Context) error) {
	wait := 100 * time.Millisecond
	for ctx.Err() == nil {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := f(cctx)
		cancel()
		if err == nil {
			return
		}
		ready.Waiting(readyConsumer, err.Error())
		log.Warn("ensuring the NATS stream and consumer failed; retrying", "err", err, "retry_in", wait.String())
		sleep(ctx, wait)
		wait = min(2*wait, 5*time.Second)
	}
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

// redacted returns rawURL with any password replaced, for logs.
func redacted(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "(unparsable url)"
	}
	return u.Redacted()
}
