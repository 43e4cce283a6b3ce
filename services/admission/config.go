package main

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"quotaflow/internal/auth"
	"quotaflow/internal/config"
	"quotaflow/internal/obs"
	"quotaflow/pkg/events/stream"
	"quotaflow/pkg/limits"
	"quotaflow/services/admission/internal/decide"
	"quotaflow/services/admission/internal/httpapi"
	"quotaflow/services/admission/internal/llmproxy"
	"quotaflow/services/admission/internal/outbox"
	"quotaflow/services/admission/internal/rls"
)

// Config is admission's configuration, read from QF_* environment variables
// by envconfig (prefix QF) over defaults(): the tags hold the defaults of
// the settings only admission's main uses, the packages that use the others
// own theirs (defaults). Validate checks it.
type Config struct {
	config.Redis  // QF_REDIS_URL
	config.NATS   // QF_NATS_URL and the streams (not the consumer settings, which admission does not use)
	config.Policy // QF_POLICY_FILE
	config.Log    // QF_LOG_LEVEL
	// AdmissionAddr is where the API listens. Without a token configured it
	// listens on loopback only (its host replaced by 127.0.0.1, with a
	// warning) and answers only requests to a loopback Host.
	AdmissionAddr string `envconfig:"ADMISSION_ADDR" default:":8080"`
	// OpsAddr is where /metrics, /healthz and /readyz listen.
	OpsAddr string `envconfig:"OPS_ADDR" default:":9090"`
	// GRPCAddr is where the gRPC services listen (ShouldRateLimit, health);
	// empty means no gRPC server. Without a token configured, on loopback
	// only, as AdmissionAddr.
	GRPCAddr string `envconfig:"GRPC_ADDR"`
	// EnvoyRateLimitConfig is envoyproxy/ratelimit's YAML configuration, a
	// file or a directory of *.yaml files (package rlsconf), reloaded on
	// change and SIGHUP; with it, the gRPC server serves ShouldRateLimit.
	EnvoyRateLimitConfig string `envconfig:"ENVOY_RATELIMIT_CONFIG"`
	// EnvoyTenantKeys and EnvoyUserKeys are the descriptor keys whose values
	// name a descriptor's tenant and user (package rls).
	EnvoyTenantKeys []string `envconfig:"ENVOY_TENANT_KEYS"`
	EnvoyUserKeys   []string `envconfig:"ENVOY_USER_KEYS"`
	// EnvoyRequestIDKey and EnvoyActualIDKey are the descriptor keys whose
	// value names the request at request time (its estimate) and in its
	// response-time call (apply_on_stream_done), which corrects the
	// estimate (package rls); both or neither.
	EnvoyRequestIDKey string `envconfig:"ENVOY_REQUEST_ID_KEY"`
	EnvoyActualIDKey  string `envconfig:"ENVOY_ACTUAL_ID_KEY"`
	// EnvoyRateLimitHeaders adds RateLimit-Limit, -Remaining and -Reset to
	// ShouldRateLimit's replies for Envoy to pass on.
	EnvoyRateLimitHeaders bool `envconfig:"ENVOY_RATELIMIT_HEADERS"`
	// Ops holds the ops port's other settings: QF_PPROF.
	obs.Ops
	// Settings are the LLM gateway mode's (QF_GATEWAY_*): with
	// QF_GATEWAY_ADDR set, admission also serves the OpenAI-compatible
	// proxy there (package llmproxy).
	llmproxy.Settings
	// Tokens are QF_API_TOKENS and QF_API_TOKENS_FILE.
	auth.Tokens
	// RedisEpochGuard keeps admission local while Redis has lost its data
	// until the accounter's rebuild; turn it off only without an accounter.
	RedisEpochGuard bool `envconfig:"REDIS_EPOCH_GUARD" default:"true"`
	// ReleaseStartupPages unmaps the binary's read-only pages once started
	// (service.ReleaseStartupPages); false keeps them mapped.
	ReleaseStartupPages bool `envconfig:"RELEASE_STARTUP_PAGES" default:"true"`
	// AuthzDenyStatus is the status of a /v1/authz denial: 429 or 403.
	AuthzDenyStatus int `envconfig:"AUTHZ_DENY_STATUS"`
	// TrustedProxies are CIDRs (or addresses) whose X-Real-IP and
	// X-Forwarded-For /v1/authz believes.
	TrustedProxies []string `envconfig:"TRUSTED_PROXIES" default:"127.0.0.0/8,::1/128"`

	// RedisTimeout bounds each Redis call; a slower one is decided locally.
	RedisTimeout time.Duration `envconfig:"REDIS_TIMEOUT"`
	// BreakerFailures consecutive failed calls open the circuit breaker.
	BreakerFailures int `envconfig:"REDIS_BREAKER_FAILURES"`
	// BreakerWindow is how long consecutive failures must last before they
	// open the breaker (one latency spike fails many calls at once); 0 opens
	// it on BreakerFailures alone.
	BreakerWindow time.Duration `envconfig:"REDIS_BREAKER_WINDOW"`
	// BreakerCooldown is how long the breaker stays open before a probe.
	BreakerCooldown time.Duration `envconfig:"REDIS_BREAKER_COOLDOWN"`
	// FailOpenAfter is how long Redis may be unreachable before every
	// request is allowed unchecked; 0 means never.
	FailOpenAfter time.Duration `envconfig:"FAILOPEN_AFTER"`
	// UnseenAllowance is the tokens per token limit a subject never seen
	// by this instance may spend while Redis is unreachable; 0 means none.
	UnseenAllowance int64 `envconfig:"UNSEEN_ALLOWANCE"`
	// LocalEntries sizes the table of what was last seen per subject,
	// tenant, IP and endpoint, for local decisions while Redis is
	// unreachable: 119 bytes each (three limits and two owners, pooled),
	// resident once used (decide.Options).
	LocalEntries int `envconfig:"LOCAL_ENTRIES"`
	// Instances is how many admission instances share the Redis (each
	// allows its share of shared limits while Redis is unreachable).
	Instances int `envconfig:"INSTANCES"`
	// LeaseBatch is how many units a lease takes from a shared request
	// limit; 0 means 10% of the limit, at most 100.
	LeaseBatch int64 `envconfig:"LEASE_BATCH"`
	// LeaseIdle is how long an unused lease pool keeps its units.
	LeaseIdle time.Duration `envconfig:"LEASE_IDLE"`
	// ReservationTTL is how long an unsettled reservation lives; at least
	// QF_STREAM_MAX_AGE, so a late actual event still finds it. Default
	// limits.DefaultReservationTTL.
	ReservationTTL time.Duration `envconfig:"RESERVATION_TTL"`

	// OutboxMaxEvents bounds the in-memory event queue; past it events
	// spill to SpillDir.
	OutboxMaxEvents int `envconfig:"OUTBOX_MAX_EVENTS"`
	// EventBatchMax is the most events one publish round carries, of the
	// outbox and of POST /v1/usage alike.
	EventBatchMax int `envconfig:"EVENT_BATCH_MAX"`
	// EventBatchWait is the longest the first report of a POST /v1/usage
	// round waits for others; 0 publishes at once (a round then takes what
	// came while the one before it was publishing).
	EventBatchWait time.Duration `envconfig:"EVENT_BATCH_WAIT"`
	// OutboxMaxWait bounds how long an event of the outbox's queue waits
	// for its round, a wait that grows with the load from none; 0
	// publishes at once.
	OutboxMaxWait time.Duration `envconfig:"OUTBOX_MAX_WAIT"`
	// SpillDir holds events NATS could not take yet; one per instance.
	SpillDir string `envconfig:"SPILL_DIR" default:"/var/tmp/quotaflow-admission-spill"`
	// SpillMaxBytes bounds SpillDir; past it events are lost (and counted).
	SpillMaxBytes int64 `envconfig:"SPILL_MAX_BYTES"`
	// ShutdownTimeout bounds the graceful shutdown on SIGTERM.
	ShutdownTimeout time.Duration `envconfig:"SHUTDOWN_TIMEOUT"`
}

// defaults is Config before the environment is read: the defaults other
// packages own (the package that uses a setting owns its default).
// envconfig keeps them where a variable is unset.
func defaults() Config {
	return Config{
		Redis: config.DefaultRedis, NATS: config.DefaultNATS, Policy: config.DefaultPolicy, Log: config.DefaultLog,
		AuthzDenyStatus: httpapi.DefaultAuthzDenyStatus,
		RedisTimeout:    decide.DefaultRedisTimeout, BreakerFailures: decide.DefaultBreakerFailures,
		BreakerWindow: decide.DefaultBreakerWindow, BreakerCooldown: decide.DefaultBreakerCooldown,
		FailOpenAfter: decide.DefaultFailOpenAfter, UnseenAllowance: decide.DefaultUnseenAllowance,
		Instances: decide.DefaultInstances, LeaseIdle: decide.DefaultLeaseIdle, LocalEntries: decide.DefaultLocalEntries,
		ReservationTTL:  limits.DefaultReservationTTL,
		OutboxMaxEvents: outbox.DefaultMaxEvents, SpillMaxBytes: outbox.DefaultMaxSpillBytes,
		EventBatchMax: stream.DefaultBatchMax, EventBatchWait: stream.DefaultBatchWait, OutboxMaxWait: outbox.DefaultQueueWait,
		ShutdownTimeout: config.DefaultShutdownTimeout, Settings: llmproxy.DefaultSettings,
		Ops: obs.Ops{HeapFloorBytes: obs.HeapFloorAdmission},
	}
}

// Validate checks every field and returns all problems at once, each
// naming its variable. It never repeats a token or a URL's password.
func (c *Config) Validate() error {
	var errs []error
	bad := func(v, format string, args ...any) {
		errs = append(errs, fmt.Errorf("QF_%s: %s", v, fmt.Sprintf(format, args...)))
	}
	errs = append(errs, c.Redis.Validate(), c.NATS.Validate(), c.Policy.Validate(), c.Log.Validate())
	if c.AdmissionAddr == "" {
		bad("ADMISSION_ADDR", "required")
	}
	if c.OpsAddr == "" {
		bad("OPS_ADDR", "required")
	}
	if c.AdmissionAddr != "" && c.AdmissionAddr == c.OpsAddr && !strings.HasSuffix(c.OpsAddr, ":0") {
		bad("OPS_ADDR", "must differ from QF_ADMISSION_ADDR")
	}
	if c.GRPCAddr != "" && (c.GRPCAddr == c.AdmissionAddr || c.GRPCAddr == c.OpsAddr) && !strings.HasSuffix(c.GRPCAddr, ":0") {
		bad("GRPC_ADDR", "must differ from QF_ADMISSION_ADDR and QF_OPS_ADDR")
	}
	if c.GatewayAddr != "" && (c.GatewayAddr == c.AdmissionAddr || c.GatewayAddr == c.OpsAddr || c.GatewayAddr == c.GRPCAddr) && !strings.HasSuffix(c.GatewayAddr, ":0") {
		bad("GATEWAY_ADDR", "must differ from QF_ADMISSION_ADDR, QF_OPS_ADDR and QF_GRPC_ADDR")
	}
	errs = append(errs, c.Tokens.Validate())
	if c.EnvoyRateLimitConfig != "" && c.GRPCAddr == "" {
		bad("ENVOY_RATELIMIT_CONFIG", "needs QF_GRPC_ADDR: ShouldRateLimit is served over gRPC")
	}
	for _, k := range c.EnvoyUserKeys {
		if slices.Contains(c.EnvoyTenantKeys, k) {
			bad("ENVOY_USER_KEYS", "%q is also a tenant key", k)
		}
	}
	for _, k := range slices.Concat(c.EnvoyTenantKeys, c.EnvoyUserKeys) {
		if k == "" || len(k) > rls.MaxIDBytes {
			bad("ENVOY_TENANT_KEYS", "a key is empty or longer than %d bytes", rls.MaxIDBytes)
			break
		}
	}
	for _, v := range [2][2]string{{"ENVOY_REQUEST_ID_KEY", c.EnvoyRequestIDKey}, {"ENVOY_ACTUAL_ID_KEY", c.EnvoyActualIDKey}} {
		name, k := v[0], v[1]
		switch {
		case len(k) > rls.MaxIDBytes:
			bad(name, "longer than %d bytes", rls.MaxIDBytes)
		case k != "" && (slices.Contains(c.EnvoyTenantKeys, k) || slices.Contains(c.EnvoyUserKeys, k)):
			bad(name, "%q is also a tenant or user key", k)
		}
	}
	switch {
	case (c.EnvoyRequestIDKey == "") != (c.EnvoyActualIDKey == ""):
		bad("ENVOY_ACTUAL_ID_KEY", "set both or neither of it and QF_ENVOY_REQUEST_ID_KEY")
	case c.EnvoyRequestIDKey != "" && c.EnvoyRequestIDKey == c.EnvoyActualIDKey:
		bad("ENVOY_ACTUAL_ID_KEY", "must differ from QF_ENVOY_REQUEST_ID_KEY")
	}
	errs = append(errs, c.Tokens.Validate())
	if c.AuthzDenyStatus != 429 && c.AuthzDenyStatus != 403 {
		bad("AUTHZ_DENY_STATUS", "%d: want 429 or 403", c.AuthzDenyStatus)
	}
	if _, err := c.Proxies(); err != nil {
		errs = append(errs, err)
	}
	if c.RedisTimeout <= 0 || c.RedisTimeout > 10*time.Second {
		bad("REDIS_TIMEOUT", "%v: want more than 0 and at most 10s (a few ms is typical)", c.RedisTimeout)
	}
	if c.BreakerFailures < 1 {
		bad("REDIS_BREAKER_FAILURES", "want at least 1")
	}
	if c.BreakerWindow < 0 {
		bad("REDIS_BREAKER_WINDOW", "must not be negative (0 opens on REDIS_BREAKER_FAILURES alone)")
	}
	if c.BreakerCooldown <= 0 {
		bad("REDIS_BREAKER_COOLDOWN", "must be positive")
	}
	if c.FailOpenAfter < 0 {
		bad("FAILOPEN_AFTER", "must not be negative (0 means never)")
	}
	if c.UnseenAllowance < 0 {
		bad("UNSEEN_ALLOWANCE", "must not be negative (0 means none)")
	}
	if c.Instances < 1 {
		bad("INSTANCES", "want at least 1")
	}
	if c.LocalEntries < 1 || c.LocalEntries > maxLocalEntries {
		bad("LOCAL_ENTRIES", "%d: want at least 1 and at most %d", c.LocalEntries, maxLocalEntries)
	}
	if c.LeaseBatch < 0 {
		bad("LEASE_BATCH", "must not be negative (0 means automatic)")
	}
	if c.LeaseIdle <= 0 {
		bad("LEASE_IDLE", "must be positive")
	}
	if c.ReservationTTL <= 0 {
		bad("RESERVATION_TTL", "must be positive")
	} else if c.ReservationTTL < c.MaxAge {
		bad("RESERVATION_TTL", "%v is shorter than QF_STREAM_MAX_AGE %v: a late actual event would find no reservation", c.ReservationTTL, c.MaxAge)
	}
	if c.OutboxMaxEvents < 1 {
		bad("OUTBOX_MAX_EVENTS", "want at least 1")
	}
	if c.EventBatchMax < 1 || c.EventBatchMax > maxEventBatch {
		bad("EVENT_BATCH_MAX", "%d: want 1 to %d", c.EventBatchMax, maxEventBatch)
	}
	if c.EventBatchWait < 0 || c.EventBatchWait > maxEventBatchWait {
		bad("EVENT_BATCH_WAIT", "%v: want 0 (publish at once) to %v (a few ms is typical): every POST /v1/usage may wait this long", c.EventBatchWait, maxEventBatchWait)
	}
	if c.OutboxMaxWait < 0 || c.OutboxMaxWait > maxEventBatchWait {
		bad("OUTBOX_MAX_WAIT", "%v: want 0 (publish at once) to %v: consumers may see an event this much later", c.OutboxMaxWait, maxEventBatchWait)
	}
	if c.SpillDir == "" {
		bad("SPILL_DIR", "required")
	}
	if c.SpillMaxBytes < 1<<20 {
		bad("SPILL_MAX_BYTES", "want at least 1048576 (1 MiB)")
	}
	if c.ShutdownTimeout <= 0 {
		bad("SHUTDOWN_TIMEOUT", "must be positive")
	}
	return errors.Join(errs...)
}

// Bounds of the event batch settings: a round of more events than the
// outbox's default queue gains nothing, and a wait near a second would make
// every usage report that slow, or every event that late for consumers.
const (
	maxEventBatch     = 10000
	maxEventBatchWait = time.Second
)

// Proxies parses TrustedProxies; a bare address is a single-address
// prefix.
func (c *Config) Proxies() ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, s := range c.TrustedProxies {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		if p, err := netip.ParsePrefix(s); err == nil {
			out = append(out, p.Masked())
			continue
		}
		a, err := netip.ParseAddr(s)
		if err != nil {
			return nil, fmt.Errorf("QF_TRUSTED_PROXIES: %q is neither a CIDR nor an address", s)
		}
		out = append(out, netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen()))
	}
	return out, nil
}

// LogArgs are the settings the "starting" line shows, without secrets.
func (c *Config) LogArgs() []any {
	return slices.Concat([]any{"admission_addr", c.AdmissionAddr, "ops_addr", c.OpsAddr, "grpc_addr", c.GRPCAddr,
		"envoy_ratelimit_config", c.EnvoyRateLimitConfig, "envoy_request_id_key", c.EnvoyRequestIDKey,
		"envoy_actual_id_key", c.EnvoyActualIDKey, "pprof", c.Pprof, "heap_floor_bytes", c.HeapFloorBytes},
		c.Policy.LogArgs(), c.Redis.LogArgs(), c.NATS.LogArgs(),
		[]any{"api_tokens_file", c.APITokensFile, "redis_epoch_guard", c.RedisEpochGuard,
			"authz_deny_status", c.AuthzDenyStatus, "spill_dir", c.SpillDir,
			"event_batch_max", c.EventBatchMax, "event_batch_wait", c.EventBatchWait.String(),
			"outbox_max_wait", c.OutboxMaxWait.String(),
			"gateway_addr", c.GatewayAddr, "gateway_upstream", c.GatewayUpstream, "gateway_file", c.GatewayFile})
}

// maxLocalEntries bounds QF_LOCAL_ENTRIES: a table of ~1.2 GB (119 bytes
// an entry: three limits of 33 and two owners of 10).
const maxLocalEntries = 10_000_000

// decideOptions are the Decider's options; where a setting's 0 means none
// or never, decide's is negative (its 0 is its default).
func (c *Config) decideOptions() decide.Options {
	o := decide.Options{
		RedisTimeout: c.RedisTimeout, BreakerFailures: c.BreakerFailures, BreakerCooldown: c.BreakerCooldown,
		BreakerWindow: breakerWindow(c.BreakerWindow), UnseenAllowance: c.UnseenAllowance, FailOpenAfter: c.FailOpenAfter,
		Instances: c.Instances, LeaseBatch: c.LeaseBatch, LeaseIdle: c.LeaseIdle, LocalEntries: c.LocalEntries,
	}
	if c.UnseenAllowance == 0 {
		o.UnseenAllowance = -1 // none
	}
	if c.FailOpenAfter == 0 {
		o.FailOpenAfter = -1 // never
	}
	return o
}

// breakerWindow maps QF_REDIS_BREAKER_WINDOW to decide's option, where zero
// means the default and a negative window none: a user who sets 0 means none.
func breakerWindow(w time.Duration) time.Duration {
	if w == 0 {
		return -1
	}
	return w
}

func (c *Config) outboxOptions(log *slog.Logger, reg prometheus.Registerer) outbox.Options {
	none := func(w time.Duration) time.Duration {
		if w == 0 {
			return -1 // none; the outbox's 0 is its default
		}
		return w
	}
	return outbox.Options{SpillDir: c.SpillDir, MaxEvents: c.OutboxMaxEvents, MaxSpillBytes: c.SpillMaxBytes,
		BatchSize: c.EventBatchMax, BatchWait: none(c.EventBatchWait), QueueWait: none(c.OutboxMaxWait), Log: log, Registerer: reg}
}
