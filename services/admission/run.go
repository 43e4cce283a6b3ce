package main

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"quotaflow/internal/config"
	"quotaflow/internal/eviction"
	"quotaflow/internal/obs"
	"quotaflow/internal/redisconn"
	"quotaflow/internal/server"
	"quotaflow/internal/service"
	"quotaflow/pkg/events/stream"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
	"quotaflow/services/admission/internal/auth"
	"quotaflow/services/admission/internal/decide"
	"quotaflow/services/admission/internal/httpapi"
	"quotaflow/services/admission/internal/outbox"
)

// source is the CloudEvents source of everything admission publishes.
const source = "quotaflow/admission"

// readyStreams is the readiness component that turns ready once the
// streams exist.
const readyStreams = "nats_streams"

// run wires the service, serves until ctx ends, then shuts down in reverse
// order: stop HTTP intake, close the Decider (returning leases), flush the
// outbox, drain NATS, close Redis. started, when not nil, is told the bound
// API and ops addresses (tests listen on port 0).
func run(ctx context.Context, cfg Config, log *slog.Logger, started func(api, ops string)) (err error) {
	reg := obs.NewRegistry()
	ready := obs.NewReadiness(readyStreams)

	tokens, err := auth.New(auth.Options{
		Tokens: cfg.APITokens, File: cfg.APITokensFile, Log: log,
		OnReload: reloadCounter(reg, prometheus.CounterOpts{
			Name: "quotaflow_admission_tokens_reloads_total",
			Help: "Reloads of QF_API_TOKENS_FILE that found new content, by result (ok, rejected).",
		}),
	})
	if err != nil {
		return err
	}
	proxies, err := cfg.Proxies()
	if err != nil {
		return err
	}
	log.Info("starting",
		"admission_addr", cfg.AdmissionAddr, "ops_addr", cfg.OpsAddr, "pprof", cfg.Pprof, "policy_file", cfg.PolicyFile,
		"redis_url", config.Redacted(cfg.RedisURL), "nats_url", config.Redacted(cfg.NATSURL),
		"stream", cfg.Stream, "subject_prefix", cfg.SubjectPrefix, "api_tokens", tokens.Len(), "api_tokens_file", cfg.APITokensFile,
		"redis_epoch_guard", cfg.RedisEpochGuard, "authz_deny_status", cfg.AuthzDenyStatus, "spill_dir", cfg.SpillDir)
	switch {
	case tokens == nil:
		log.Warn("QF_API_TOKENS and QF_API_TOKENS_FILE are empty: the API accepts requests without authentication")
	case tokens.Len() == 0:
		log.Warn("no API token is in force: every request gets 401 until QF_API_TOKENS_FILE holds one")
	}

	// The ops server first, so /healthz answers during start-up.
	ops, err := server.Listen(cfg.OpsAddr, "ops", obs.OpsHandler(reg, ready, cfg.Ops), log)
	if err != nil {
		return err
	}
	defer service.ShutdownStep(log, "ops server", cfg.ShutdownTimeout, ops.Shutdown)

	// Policy: reload on file change and on SIGHUP.
	policyReloaded := reloadCounter(reg, prometheus.CounterOpts{
		Name: "quotaflow_admission_policy_reloads_total",
		Help: "Policy reloads that found new content, by result (ok, rejected).",
	})
	watcher, err := service.NewPolicyWatcher(cfg.PolicyFile, log, service.WithPolicyReloadHook(func(_ *policy.Policy, err error) {
		policyReloaded(err)
	}))
	if err != nil {
		return err
	}
	var bg sync.WaitGroup // background goroutines, stopped by bgCancel
	bgCtx, bgCancel := context.WithCancel(context.Background())
	defer func() { bgCancel(); bg.Wait() }()
	bg.Go(func() { service.WatchPolicy(bgCtx, watcher, log) })
	bg.Go(func() { tokens.Watch(bgCtx) }) // returns at once without a tokens file

	// Redis and the Decider.
	rdb, err := redisconn.Open(cfg.RedisURL)
	if err != nil {
		return err
	}
	defer rdb.Close()
	evict := eviction.New(rdb, log)
	evict.Report(ready)
	bg.Go(func() { evict.Run(bgCtx, eviction.Interval) })
	dopts := decide.Options{
		RedisTimeout:    cfg.RedisTimeout,
		BreakerFailures: cfg.BreakerFailures,
		BreakerCooldown: cfg.BreakerCooldown,
		BreakerWindow:   breakerWindow(cfg.BreakerWindow),
		UnseenAllowance: cfg.UnseenAllowance,
		FailOpenAfter:   cfg.FailOpenAfter,
		Instances:       cfg.Instances,
		LeaseBatch:      cfg.LeaseBatch,
		LeaseIdle:       cfg.LeaseIdle,
	}
	if cfg.UnseenAllowance == 0 {
		dopts.UnseenAllowance = -1 // none (decide reads 0 as its default)
	}
	if cfg.FailOpenAfter == 0 {
		dopts.FailOpenAfter = -1 // never
	}
	lim := limits.New(rdb, limits.Options{ReservationTTL: cfg.ReservationTTL, NoEpochGuard: !cfg.RedisEpochGuard})
	dec, err := decide.New(lim, watcher.Current, dopts, log, reg)
	if err != nil {
		return err
	}
	decClosed := false
	defer func() {
		if !decClosed {
			service.ShutdownStep(log, "decider", cfg.ShutdownTimeout, dec.Close)
		}
	}()
	ready.Watch("redis", dec.Degraded)

	// NATS: connect even while it is down and reconnect forever; events
	// wait in the outbox meanwhile.
	nc, err := nats.Connect(cfg.NATSURL,
		nats.Name("quotaflow-admission"),
		nats.MaxReconnects(-1),
		nats.RetryOnFailedConnect(true),
		nats.ReconnectWait(500*time.Millisecond),
		nats.DrainTimeout(cfg.ShutdownTimeout),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			log.Warn("nats disconnected; events are queued", "err", err)
		}),
		nats.ReconnectHandler(func(*nats.Conn) { log.Info("nats reconnected") }),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			log.Warn("nats error", "err", err)
		}),
	)
	if err != nil {
		return fmt.Errorf("nats: %w", err)
	}
	ncDrained := false
	defer func() {
		if !ncDrained {
			nc.Close()
		}
	}()
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(outbox.DefaultPublishTimeout))
	if err != nil {
		return fmt.Errorf("jetstream: %w", err)
	}
	// Admission keeps events in its outbox (and spill) before the stream
	// does: they are stamped with their own time as first stored.
	ob, err := outbox.New(stream.NewPublisher(js, cfg.Config, stream.WithOwnTime()), outbox.Options{
		SpillDir:      cfg.SpillDir,
		MaxEvents:     cfg.OutboxMaxEvents,
		MaxSpillBytes: cfg.SpillMaxBytes,
		Source:        source,
		Log:           log,
		Registerer:    reg,
	})
	if err != nil {
		return err
	}
	obClosed := false
	defer func() {
		if !obClosed {
			service.ShutdownStep(log, "outbox", cfg.ShutdownTimeout, ob.Close)
		}
	}()
	ready.Watch("nats", func() (bool, string) {
		if !nc.IsConnected() {
			return true, "not connected (" + nc.Status().String() + "); events are queued"
		}
		return ob.Degraded()
	})
	bg.Go(func() { ensureStreams(bgCtx, js, cfg.Config, ready, log) })

	// The API last: everything it needs is in place.
	api, err := httpapi.New(httpapi.Options{
		Decider:         dec,
		Policy:          watcher.Current,
		Events:          ob,
		Auth:            tokens,
		AuthzDenyStatus: cfg.AuthzDenyStatus,
		TrustedProxies:  proxies,
		MaxEventAge:     cfg.MaxAge,
		Source:          source,
		Log:             log,
		Registerer:      reg,
	})
	if err != nil {
		return err
	}
	srv, err := server.Listen(cfg.AdmissionAddr, "api", api, log)
	if err != nil {
		return err
	}
	log.Info("admission started", "api", srv.Addr(), "ops", ops.Addr(), "policy_digest", watcher.Current().Digest())
	if started != nil {
		started(srv.Addr(), ops.Addr())
	}

	<-ctx.Done()
	log.Info("shutting down")
	ready.Drain()
	service.ShutdownStep(log, "api server", cfg.ShutdownTimeout, srv.Shutdown)
	decClosed = true
	service.ShutdownStep(log, "decider", cfg.ShutdownTimeout, dec.Close)
	obClosed = true
	service.ShutdownStep(log, "outbox", cfg.ShutdownTimeout, ob.Close)
	ncDrained = true
	service.ShutdownStep(log, "nats", cfg.ShutdownTimeout, func(ctx context.Context) error { return service.DrainNATS(ctx, nc) })
	log.Info("stopped")
	return nil
}

// reloadCounter registers a counter of a file's reloads by result (ok,
// rejected), both series starting at zero, and returns the hook that
// counts one reload: nil error for ok.
func reloadCounter(reg prometheus.Registerer, opts prometheus.CounterOpts) func(error) {
	c := prometheus.NewCounterVec(opts, []string{"result"})
	ok, rejected := c.WithLabelValues("ok"), c.WithLabelValues("rejected")
	reg.MustRegister(c)
	return func(err error) {
		if err != nil {
			rejected.Inc()
		} else {
			ok.Inc()
		}
	}
}

// ensureStreams creates or updates the streams, retrying until it works
// (NATS may start after admission), then marks the service ready.
func ensureStreams(ctx context.Context, js jetstream.JetStream, cfg stream.Config, ready *obs.Readiness, log *slog.Logger) {
	wait := 100 * time.Millisecond
	for {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := stream.Ensure(cctx, js, cfg)
		cancel()
		if err == nil {
			ready.Ready(readyStreams)
			log.Info("streams ready", "stream", cfg.Stream)
			return
		}
		ready.Waiting(readyStreams, err.Error())
		log.Warn("ensuring the NATS streams failed; retrying", "err", err, "retry_in", wait.String())
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		wait = min(2*wait, 5*time.Second)
	}
}

// breakerWindow maps QF_REDIS_BREAKER_WINDOW to decide's option, where zero
// means the default and a negative window none: a user who sets 0 means none.
func breakerWindow(w time.Duration) time.Duration {
	if w == 0 {
		return -1
	}
	return w
}
