package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/internal/config"
	"quotaflow/internal/filewatch"
	"quotaflow/internal/obs"
	"quotaflow/internal/pgdb"
	"quotaflow/internal/server"
	"quotaflow/internal/service"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
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
		"ops_addr", cfg.OpsAddr, "pprof", cfg.Pprof, "postgres_url", config.Redacted(cfg.PostgresURL), "nats_url", config.Redacted(cfg.NATSURL), "stream", cfg.Stream,
		"subject_prefix", cfg.SubjectPrefix, "consumer", cfg.Consumer, "webhooks_file", cfg.WebhooksFile)

	hooks, err := deliver.Load(cfg.WebhooksFile, detect.Kinds)
	if err != nil {
		return err
	}
	if len(hooks) == 0 {
		log.Warn("no webhooks configured: alerts are detected and counted but not sent")
	}

	ops, err := server.Listen(cfg.OpsAddr, "ops", obs.OpsHandler(reg, ready, cfg.Ops), log)
	if err != nil {
		return err
	}
	defer service.ShutdownStep(log, "ops server", cfg.ShutdownTimeout, ops.Shutdown)
	if started != nil {
		started(ops.Addr())
	}

	pool := openPostgres(ctx, cfg.PostgresURL, ready, log)
	if pool == nil {
		return nil // ctx ended while Postgres was unavailable
	}
	defer pool.Close()
	ready.Ready(readyPostgres)
	st := store.New(pool)

	dl, err := deliver.New(st, hooks, deliver.Options{
		AttemptTimeout: cfg.DeliveryTimeout, MinBackoff: cfg.DeliveryMinBackoff, MaxBackoff: cfg.DeliveryMaxBackoff,
		MaxAge: cfg.DeliveryMaxAge, Poll: cfg.DeliveryPoll,
	}, log, reg)
	if err != nil {
		return err
	}
	det, err := detect.New(st, dl.Route, detect.Options{
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
	if cfg.WebhooksFile != "" {
		w, err := deliver.NewWatcher(cfg.WebhooksFile, detect.Kinds, dl.SetWebhooks, log)
		if err != nil {
			return err
		}
		bg.Go(func() { watchWebhooks(bgCtx, w, log) })
	}

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
	handlers := stream.Handlers{Reserved: det.Reserved, Corrected: det.Corrected, Denied: det.Denied}
	var consumer sync.WaitGroup
	cctx, ccancel := context.WithCancel(ctx)
	defer ccancel()
	consumer.Go(func() { consume(cctx, js, cfg, handlers.Dispatch, det.HandleBatch, ready, log) })

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

// watchWebhooks keeps the webhooks of w current until ctx ends: it
// reloads the file when it changes and on SIGHUP; a rejected file is
// logged and the last good webhooks stay in force.
func watchWebhooks(ctx context.Context, w *deliver.Watcher, log *slog.Logger) {
	filewatch.OnSIGHUP(ctx, log, "webhooks file", w.Run, func() { w.ReloadAndLog("SIGHUP") })
}

// consume ensures the streams and the durable consumer (retrying while
// NATS is unavailable), marks the service ready, then processes events
// until ctx ends: in batches of what has arrived (up to maxBatch), each
// handled by batch in one Postgres transaction and then acked, falling
// back to handle event by event when a batch fails.
func consume(ctx context.Context, js jetstream.JetStream, cfg Config, handle stream.Handler,
	batch func(context.Context, []events.Event) error, ready *obs.Readiness, log *slog.Logger) {
	log = log.With("component", "consume")
	var cons jetstream.Consumer
	retry(ctx, log, ready, readyConsumer, "ensuring the NATS stream and consumer", func(ctx context.Context) error {
		if err := stream.Ensure(ctx, js, cfg.Config); err != nil {
			return err
		}
		c, err := stream.EnsureConsumer(ctx, js, cfg.Config, cfg.Consumer)
		cons = c
		return err
	})
	if ctx.Err() != nil {
		return
	}
	ready.Ready(readyConsumer)
	log.Info("consuming", "stream", cfg.Stream, "consumer", cfg.Consumer)
	msgs := make([]jetstream.Msg, 0, maxBatch)
	for ctx.Err() == nil {
		it, err := cons.Messages(jetstream.PullMaxMessages(maxBatch))
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
			// Take what else has arrived, up to maxBatch, without waiting
			// for more than a moment.
			msgs = append(msgs[:0], msg)
			for len(msgs) < maxBatch {
				m, err := it.Next(jetstream.NextMaxWait(time.Millisecond))
				if err != nil {
					break
				}
				msgs = append(msgs, m)
			}
			processBatch(ctx, js, cfg, msgs, handle, batch, log)
		}
		stop()
		it.Stop()
	}
}

// maxBatch is the most events handled in one Postgres transaction.
const maxBatch = 256

// processBatch handles msgs with batch (one transaction for all) and acks
// them. Events that do not decode are dead-lettered; when batch fails,
// each event is processed on its own by stream.Process (so one bad event
// is retried and dead-lettered alone, and the others go through).
func processBatch(ctx context.Context, js jetstream.JetStream, cfg Config, msgs []jetstream.Msg,
	handle stream.Handler, batch func(context.Context, []events.Event) error, log *slog.Logger) {
	evs := make([]events.Event, 0, len(msgs))
	ok := make([]jetstream.Msg, 0, len(msgs))
	for _, m := range msgs {
		ev, err := stream.DecodeMsg(m, cfg.Config)
		if err != nil {
			// Process dead-letters what does not decode.
			if err := stream.Process(ctx, js, cfg.Config, m, handle); err != nil && ctx.Err() == nil {
				log.Warn("event not processed", "subject", m.Subject(), "err", err)
			}
			continue
		}
		evs, ok = append(evs, ev), append(ok, m)
	}
	if len(evs) == 0 {
		return
	}
	if err := batch(ctx, evs); err != nil {
		if ctx.Err() != nil {
			for _, m := range ok {
				_ = m.Nak() // shutting down: hand them to another worker now
			}
			return
		}
		log.Warn("event batch failed; processing its events one by one", "events", len(evs), "err", err)
		for _, m := range ok {
			if err := stream.Process(ctx, js, cfg.Config, m, handle); err != nil && ctx.Err() == nil {
				log.Warn("event not processed", "subject", m.Subject(), "err", err)
			}
		}
		return
	}
	for _, m := range ok {
		if err := m.Ack(); err != nil {
			log.Warn("ack event", "subject", m.Subject(), "err", err)
		}
	}
}

// openPostgres opens the database of url and applies the migrations,
// retrying with backoff while Postgres does not answer (or the migration
// fails), with /readyz reporting "waiting for postgres" meanwhile. It
// returns nil when ctx ends first.
func openPostgres(ctx context.Context, url string, ready *obs.Readiness, log *slog.Logger) *pgxpool.Pool {
	var pool *pgxpool.Pool
	retry(ctx, log, ready, readyPostgres, "opening and migrating postgres", func(ctx context.Context) error {
		p, err := pgdb.Open(ctx, url)
		if err != nil {
			return fmt.Errorf("waiting for postgres: %w", err)
		}
		if err := store.Migrate(ctx, p); err != nil {
			p.Close()
			return fmt.Errorf("waiting for postgres: %w", err)
		}
		pool = p
		return nil
	})
	return pool
}

// retry calls f until it succeeds or ctx ends, backing off up to 5 s,
// reporting f's error as why component is not ready and logging what
// failed.
func retry(ctx context.Context, log *slog.Logger, ready *obs.Readiness, component, what string, f func(context.Context) error) {
	wait := 100 * time.Millisecond
	for ctx.Err() == nil {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := f(cctx)
		cancel()
		if err == nil {
			return
		}
		if ctx.Err() != nil {
			return
		}
		ready.Waiting(component, err.Error())
		log.Warn(what+" failed; retrying", "err", err, "retry_in", wait.String())
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
