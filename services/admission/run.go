package main

import (
	"context"
	"log/slog"
	"os"

	authv3 "github.com/envoyproxy/go-control-plane/envoy/service/auth/v3"
	rlspb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"quotaflow/internal/auth"
	"quotaflow/internal/heapfloor"
	"quotaflow/internal/obs"
	"quotaflow/internal/service"
	"quotaflow/pkg/events/stream"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
	"quotaflow/services/admission/internal/decide"
	"quotaflow/services/admission/internal/extauthz"
	"quotaflow/services/admission/internal/grpcapi"
	"quotaflow/services/admission/internal/httpapi"
	"quotaflow/services/admission/internal/llmproxy"
	"quotaflow/services/admission/internal/openai"
	"quotaflow/services/admission/internal/outbox"
	"quotaflow/services/admission/internal/rls"
	"quotaflow/services/admission/internal/rlsconf"
)

// The readiness components: readyStreams turns ready once the streams
// exist, readyListening once every listener (API, gRPC, LLM gateway) takes
// connections. The gateway starts last, after loading the tokenizer's
// vocabularies (seconds on a loaded host): a load balancer told ready
// sooner sends requests to a port nobody listens on.
const (
	readyStreams   = "nats_streams"
	readyListening = "listeners"
)

// hooks lets tests observe run; main passes none.
type hooks struct {
	started func(api, ops string) // told the bound addresses (tests listen on port 0)
	grpc    func(addr string)     // told the gRPC server's address, when there is one
	gateway func(addr string)     // told the LLM gateway's address, when there is one
}

// run wires admission and serves until ctx ends; then the stack stops what
// it started in reverse: gRPC and HTTP intake first, the Decider (returning its
// leases), the outbox (flushed, or spilled), NATS (drained), Redis, the
// file watchers, the ops server.
func run(ctx context.Context, cfg Config, log *slog.Logger, h hooks) error {
	reg, ready := obs.NewRegistry(), obs.NewReadiness(readyStreams, readyListening)
	stack := service.NewStack(log, cfg.ShutdownTimeout, ready)
	defer stack.Close()
	m := newMetrics(reg)
	tokens, err := auth.New(cfg.Tokens.Options(log, m.tokensReloaded))
	if err != nil {
		return err
	}
	// The ops server first, so /healthz answers during start-up.
	ops, err := service.Listen(stack, "ops", cfg.OpsAddr, obs.OpsHandler(reg, ready, cfg.Ops))
	if err != nil {
		return err
	}
	watcher, err := service.WatchPolicy(stack, cfg.PolicyFile, log, service.WithPolicyReloadHook(m.policyReloaded))
	if err != nil {
		return err
	}
	stack.Go("tokens file", tokens.Watch) // returns at once without a file
	rdb, err := service.OpenRedis(stack, cfg.RedisURL)
	if err != nil {
		return err
	}
	// NATS even while it is down: events wait in the outbox meanwhile.
	nc, js, err := service.ConnectNATS(stack, "admission", cfg.NATSURL, jetstream.WithPublishAsyncTimeout(outbox.DefaultPublishTimeout))
	if err != nil {
		return err
	}
	ob, err := outbox.New(stream.NewPublisher(js, cfg.Config, stream.WithOwnTime(), stream.WithMaxPayload(nc.MaxPayload())), cfg.outboxOptions(log, reg))
	if err != nil {
		return err
	}
	stack.Push("outbox", ob.Close)
	ready.Watch("nats", natsStatus(nc, ob))
	stack.Go("streams", func(ctx context.Context) { service.Retry(ctx, log, ready, readyStreams, ensureStreams(js, cfg)) })
	lim := limits.New(rdb, limits.Options{ReservationTTL: cfg.ReservationTTL, NoEpochGuard: !cfg.RedisEpochGuard})
	stack.Go("engines", func(ctx context.Context) { service.DropOtherEngines(ctx, lim, log) })
	dec, err := decide.New(lim, watcher.Current, cfg.decideOptions(), log, reg)
	if err != nil {
		return err
	}
	stack.Push("decider", dec.Close)
	heapfloor.Count(dec.LocalBytes)
	ready.Watch("redis", dec.Degraded)
	// The API last: everything it needs is in place.
	api, err := newAPI(cfg, dec, watcher.Current, ob, tokens, log, reg)
	if err != nil {
		return err
	}
	// Without tokens every caller may act for every tenant (top up, read
	// usage, release): loopback only, as the accounter's console.
	srv, err := service.ListenAPI(stack, "api", "admission_addr", cfg.AdmissionAddr, tokens, api)
	if err != nil {
		return err
	}
	if cfg.GRPCAddr != "" {
		g, err := startGRPC(stack, cfg, dec, rdb, api, tokens, ready, log, reg, m)
		if err != nil {
			return err
		}
		log.Info("grpc started", "grpc", g.Addr())
		if h.grpc != nil {
			h.grpc(g.Addr())
		}
	}
	if cfg.GatewayAddr != "" {
		addr, err := startGateway(stack, cfg, api, log, reg, m)
		if err != nil {
			return err
		}
		log.Info("llm gateway started", "gateway", addr)
		if h.gateway != nil {
			h.gateway(addr)
		}
	}
	ready.Ready(readyListening)
	// Start-up is done: what only it ran need not stay resident.
	var released int64
	if cfg.ReleaseStartupPages {
		if released, err = service.ReleaseStartupPages(); err != nil {
			log.Warn("start-up pages not all released", "err", err)
		}
	}
	log.Info("admission started", "api", srv.Addr(), "ops", ops.Addr(), "policy_digest", watcher.Current().Digest(),
		"startup_pages_released", released)
	if h.started != nil {
		h.started(srv.Addr(), ops.Addr())
	}
	<-ctx.Done()
	return nil
}

// startGRPC starts the gRPC server with ext_authz's Check, answered as
// api answers /v1/authz, and ShouldRateLimit when QF_ENVOY_RATELIMIT_CONFIG
// is set; the stack stops it in its turn, before the Decider, letting the
// calls in flight finish.
func startGRPC(stack *service.Stack, cfg Config, dec *decide.Decider, rdb redis.UniversalClient, api *httpapi.Handler, tokens *auth.Auth,
	ready *obs.Readiness, log *slog.Logger, reg prometheus.Registerer, m metrics) (*grpcapi.Server, error) {
	g, err := grpcapi.New(grpcapi.Options{Auth: tokens, Ready: ready, Log: log, Registerer: reg})
	if err != nil {
		return nil, err
	}
	g.Register(&authv3.Authorization_ServiceDesc, extauthz.New(api), auth.Gateway)
	if cfg.EnvoyRateLimitConfig != "" {
		w, err := rlsconf.NewWatcher(cfg.EnvoyRateLimitConfig, log, m.envoyReloaded)
		if err != nil {
			return nil, err
		}
		stack.Go("envoy ratelimit config", w.Watch)
		h, err := rls.New(rls.Options{Checker: dec, Config: w.Current, TenantKeys: cfg.EnvoyTenantKeys,
			UserKeys: cfg.EnvoyUserKeys, Headers: cfg.EnvoyRateLimitHeaders, RequestIDKey: cfg.EnvoyRequestIDKey,
			ActualIDKey: cfg.EnvoyActualIDKey, Corrector: dec, Records: rdb, RecordTimeout: cfg.RedisTimeout, RecordTTL: cfg.ReservationTTL, Registerer: reg, Log: log})
		if err != nil {
			return nil, err
		}
		g.Register(&rlspb.RateLimitService_ServiceDesc, h, auth.Gateway)
	}
	// Loopback only without tokens, as the API, but no check of :authority
	// (the Host check's analogue): browsers speak no plaintext HTTP/2, so a
	// rebinding page cannot make a call, while Envoy sends its cluster's name.
	if err := g.Listen(service.APIAddr(stack, "grpc server", "grpc_addr", cfg.GRPCAddr, tokens)); err != nil {
		return nil, err
	}
	stack.Push("grpc server", g.Stop)
	return g, nil
}

// startGateway serves the LLM gateway mode (package llmproxy) on
// QF_GATEWAY_ADDR, admitting, releasing and charging through api; the
// stack stops it before the API, then waits for its requests to settle.
// It keeps its address without API tokens: its callers are identified by
// the gateway's own keys (or an outer gateway's headers), each for one
// tenant, never by an API token.
func startGateway(stack *service.Stack, cfg Config, api *httpapi.Handler, log *slog.Logger,
	reg prometheus.Registerer, m metrics) (string, error) {
	// The tokenizer's vocabularies load now, not in the first request.
	if err := openai.Warm(); err != nil {
		return "", err
	}
	w, err := llmproxy.NewWatcher(cfg.Settings, os.Getenv, log, m.gatewayReloaded)
	if err != nil {
		return "", err
	}
	stack.Go("gateway file", w.Watch) // returns at once without a file
	px, err := llmproxy.New(llmproxy.Options{Config: w.Current, Admitter: api,
		DefaultMaxTokens: cfg.GatewayDefaultMaxTokens, ReferenceTokens: cfg.GatewayReferenceTokens, Log: log, Registerer: reg})
	if err != nil {
		return "", err
	}
	stack.Push("gateway settling", px.Close) // after the server stopped, before the Decider and outbox
	srv, err := service.Listen(stack, "gateway", cfg.GatewayAddr, px)
	if err != nil {
		return "", err
	}
	return srv.Addr(), nil
}

// metrics are run's own: the reloads of the files it watches.
type metrics struct {
	tokensReloaded  func(error)
	policyReloaded  func(*policy.Policy, error)
	envoyReloaded   func(error)
	gatewayReloaded func(error)
}

func newMetrics(reg prometheus.Registerer) metrics {
	policyCounted := reloadCounter(reg, prometheus.CounterOpts{
		Name: "quotaflow_admission_policy_reloads_total",
		Help: "Policy reloads that found new content, by result (ok, rejected).",
	})
	return metrics{
		tokensReloaded: reloadCounter(reg, prometheus.CounterOpts{
			Name: "quotaflow_admission_tokens_reloads_total",
			Help: "Reloads of QF_API_TOKENS_FILE that found new content, by result (ok, rejected).",
		}),
		policyReloaded: func(_ *policy.Policy, err error) { policyCounted(err) },
		envoyReloaded: reloadCounter(reg, prometheus.CounterOpts{
			Name: "quotaflow_admission_envoy_config_reloads_total",
			Help: "Reloads of QF_ENVOY_RATELIMIT_CONFIG that found new content, by result (ok, rejected).",
		}),
		gatewayReloaded: reloadCounter(reg, prometheus.CounterOpts{
			Name: "quotaflow_admission_gateway_file_reloads_total",
			Help: "Reloads of QF_GATEWAY_FILE that found new content, by result (ok, rejected).",
		}),
	}
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

// natsStatus reports NATS as degraded while the connection is down (events
// are queued meanwhile) or the outbox is behind, for /readyz.
func natsStatus(nc *nats.Conn, ob *outbox.Outbox) func() (bool, string) {
	return func() (bool, string) {
		if !nc.IsConnected() {
			return true, "not connected (" + nc.Status().String() + "); events are queued"
		}
		return ob.Degraded()
	}
}

// ensureStreams returns the start-up step that creates or updates the
// streams, for service.Retry: NATS may come up after admission, which
// serves meanwhile (events wait in the outbox) but is not ready.
func ensureStreams(js jetstream.JetStream, cfg Config) func(context.Context) (struct{}, error) {
	return func(ctx context.Context) (struct{}, error) { return struct{}{}, stream.Ensure(ctx, js, cfg.Config) }
}

// newAPI returns the API handler over what run started.
func newAPI(cfg Config, dec *decide.Decider, current func() *policy.Policy, ob *outbox.Outbox, tokens *auth.Auth,
	log *slog.Logger, reg prometheus.Registerer) (*httpapi.Handler, error) {
	proxies, err := cfg.Proxies()
	if err != nil {
		return nil, err
	}
	return httpapi.New(httpapi.Options{
		Decider: dec, Policy: current, Events: ob, Auth: tokens, AuthzDenyStatus: cfg.AuthzDenyStatus,
		TrustedProxies: proxies, MaxEventAge: cfg.MaxAge, Log: log, Registerer: reg,
	})
}
