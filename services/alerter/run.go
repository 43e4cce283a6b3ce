package main

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/internal/alertlog"
	"quotaflow/internal/obs"
	"quotaflow/internal/pgdb"
	"quotaflow/internal/service"
	"quotaflow/pkg/events/stream"
	"quotaflow/pkg/limits/policy"
	"quotaflow/services/alerter/internal/consume"
	"quotaflow/services/alerter/internal/deliver"
	"quotaflow/services/alerter/internal/detect"
	"quotaflow/services/alerter/internal/store"
)

// Readiness components: /readyz is 503 until both are ready.
const (
	readyPostgres = "postgres"
	readyConsumer = "nats_consumer"
)

// hooks lets tests observe run; main passes none.
type hooks struct {
	started func(ops string)  // told the bound ops address (tests listen on port 0)
	alerts  func(addr string) // told the alerts API's bound address
}

// run wires the alerter and consumes until ctx ends; then the stack stops
// what it started in reverse: detection and delivery (attempts in flight
// are retried after their lease), NATS drained, the alerts API, Postgres,
// the ops server.
// Stopped while it waits for Postgres or NATS, it returns nil.
func run(ctx context.Context, cfg Config, log *slog.Logger, h hooks) error {
	reg, ready := obs.NewRegistry(), obs.NewReadiness(readyPostgres, readyConsumer)
	stack := service.NewStack(log, cfg.ShutdownTimeout, ready)
	defer stack.Close()
	webhooks, err := deliver.Load(cfg.WebhooksFile, detect.Kinds)
	if err != nil {
		return err
	}
	ops, err := service.Listen(stack, "ops", cfg.OpsAddr, obs.OpsHandler(reg, ready, cfg.Ops))
	if err != nil {
		return err
	}
	if h.started != nil {
		h.started(ops.Addr())
	}

	pool, ok := service.Open(ctx, stack, readyPostgres, "postgres", pgdb.Connect(cfg.PostgresURL, store.Migrate, log), (*pgxpool.Pool).Close)
	if !ok {
		return nil
	}
	st := store.New(pool)
	tokens, err := service.OpenTokens(stack, cfg.Tokens, log)
	if err != nil {
		return err
	}
	api, err := service.ListenAPI(stack, "alerts API", "alerts_addr", cfg.AlertsAddr, tokens, alertlog.NewHandler(pool, tokens, log))
	if err != nil {
		return err
	}
	if h.alerts != nil {
		h.alerts(api.Addr())
	}
	dl, err := deliver.New(st, webhooks, cfg.deliverOptions(), log, reg)
	if err != nil {
		return err
	}
	det, err := detect.New(st, dl.Route, cfg.detectOptions(), log, reg, dl.Notify)
	if err != nil {
		return err
	}
	if err := det.Load(ctx); err != nil {
		return err
	}
	if err := watchPolicy(ctx, stack, cfg.PolicyFile, det, log); err != nil {
		return err
	}
	_, js, err := service.ConnectNATS(stack, "alerter", cfg.NATSURL)
	if err != nil {
		return err
	}
	stack.Go("delivery", dl.Run)
	stack.Go("outbox retention", dl.Retain)
	stack.Go("detection", func(ctx context.Context) { det.Run(ctx, cfg.EvalInterval) })
	if err := watchWebhooks(stack, cfg.WebhooksFile, dl, log); err != nil {
		return err
	}

	cons, ok := service.Retry(ctx, log, ready, readyConsumer, func(ctx context.Context) (jetstream.Consumer, error) {
		if err := stream.Ensure(ctx, js, cfg.Config); err != nil {
			return nil, err
		}
		return stream.EnsureConsumer(ctx, js, cfg.Config, cfg.Consumer)
	})
	if !ok {
		return nil
	}
	consume.Run(ctx, cons, js, cfg.Config, det, log) // until ctx ends
	return nil
}

// watchWebhooks keeps dl's webhooks those of file, when one is set, until
// the stack stops it: reloaded when the file changes and on SIGHUP.
func watchWebhooks(stack *service.Stack, file string, dl *deliver.Deliverer, log *slog.Logger) error {
	if file == "" {
		return nil
	}
	w, err := deliver.NewWatcher(file, detect.Kinds, dl.SetWebhooks, log)
	if err != nil {
		return err
	}
	stack.Go("webhooks file", w.Watch)
	return nil
}

// watchPolicy, when file is set, gives det the alert thresholds of the
// policy in file (Detector.SetPolicy) and prunes det's raised limits by it
// (Detector.Prune), now and after every reload until the stack stops it
// (prunePolicy): the file is reloaded when it changes and on SIGHUP.
// Without a file every limit alerts at 80, 90 and 100 %.
func watchPolicy(ctx context.Context, stack *service.Stack, file string, det *detect.Detector, log *slog.Logger) error {
	if file == "" {
		return nil
	}
	reloaded := make(chan struct{}, 1)
	w, err := service.WatchPolicy(stack, file, log, service.WithPolicyReloadHook(func(p *policy.Policy, err error) {
		if err != nil {
			return
		}
		det.SetPolicy(p)
		select { // the hook runs under the reload lock: the pruning waits elsewhere
		case reloaded <- struct{}{}:
		default: // one pending is enough: it prunes by the policy then current
		}
	}))
	if err != nil {
		return err
	}
	det.SetPolicy(w.Current())
	if _, err := det.Prune(ctx, w.Current()); err != nil {
		return err
	}
	stack.Go("policy pruning", func(ctx context.Context) {
		prunePolicy(ctx, det, w.Current, reloaded, func() <-chan time.Time { return time.After(rePruneAfter) }, log)
	})
	return nil
}

// rePruneAfter is how long after a prune by a newly loaded policy the
// alerter prunes once more: admission reloads the same file on its own
// (within its debounce; a mounted ConfigMap reaches pods up to about a
// minute apart), and until it has, and its snapshots made before have been
// consumed, a snapshot can raise a limit the reload removed after the
// prune, to stay raised until the next reload.
const rePruneAfter = time.Minute

// prunePolicy prunes det's raised limits by current() on every signal of
// reloaded, and again when the channel again returns fires: after the
// start's prune and each reload's, then for as long as the last one
// re-armed a limit or failed (admission instances still on the older
// policy keep raising removed limits). again is time.After(rePruneAfter)
// but in tests.
func prunePolicy(ctx context.Context, det *detect.Detector, current func() *policy.Policy, reloaded <-chan struct{}, again func() <-chan time.Time, log *slog.Logger) {
	wait := again()
	for {
		reload := false
		select {
		case <-ctx.Done():
			return
		case <-reloaded:
			reload = true
		case <-wait:
		}
		n, err := det.Prune(ctx, current())
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			// Kept raised until the next prune: correct, only larger.
			log.Error("re-arm the limits a policy reload removed", "err", err)
		}
		wait = nil
		if reload || n > 0 || err != nil {
			wait = again()
		}
	}
}
