package main

import (
	"errors"
	"fmt"
	"net"
	"slices"
	"time"

	"quotaflow/internal/auth"
	"quotaflow/internal/config"
	"quotaflow/internal/obs"
	"quotaflow/services/alerter/internal/deliver"
	"quotaflow/services/alerter/internal/detect"
)

// Config is the alerter's configuration, read from QF_* environment
// variables by envconfig (prefix QF) over defaults(): the tags hold the
// defaults of the settings only the alerter's main uses, the packages that
// use the others own theirs (defaults). Validate checks it.
type Config struct {
	config.NATS     // QF_NATS_URL, the streams and the consumer's redelivery
	config.Postgres // QF_POSTGRES_URL: the alert state and the webhook outbox
	config.Log      // QF_LOG_LEVEL
	// Consumer is the durable consumer's name; alerter instances sharing
	// it split the events.
	Consumer string `envconfig:"CONSUMER" default:"quotaflow-alerter"`
	// OpsAddr is where /metrics, /healthz and /readyz listen.
	OpsAddr string `envconfig:"OPS_ADDR" default:":9092"`
	// Ops holds the ops port's other settings: QF_PPROF.
	obs.Ops
	// AlertsAddr is where GET /v1/alerts serves tenants' recent alerts
	// (package alertlog), for the accounter's console when the outbox is
	// not in its database. Without a token configured it listens on
	// loopback only: its host is replaced by 127.0.0.1, with a warning.
	AlertsAddr string `envconfig:"ALERTS_ADDR" default:":8082"`
	// Tokens are QF_API_TOKENS and QF_API_TOKENS_FILE, admission's tokens,
	// which scope AlertsAddr as they scope the accounter's console.
	auth.Tokens
	// WebhooksFile is the YAML list of webhook endpoints (docs/design.md §7);
	// empty means none (alerts are detected and counted, not sent). It is
	// reloaded when it changes and on SIGHUP.
	WebhooksFile string `envconfig:"WEBHOOKS_FILE"`
	// PolicyFile is the policy admission enforces (QF_POLICY_FILE). It is
	// reloaded when it changes and on SIGHUP, and the raised thresholds of
	// limits it no longer defines are re-armed and forgotten; empty means
	// none is read and they are kept.
	PolicyFile string `envconfig:"POLICY_FILE"`

	// Hysteresis is how many percentage points usage must fall under a
	// fired threshold to re-arm it.
	Hysteresis float64 `envconfig:"ALERT_HYSTERESIS"`
	// SpikeRate is the denial rate (0-1) above which a spike fires.
	SpikeRate float64 `envconfig:"SPIKE_RATE"`
	// SpikeMinRequests is the fewest requests in SpikeWindow for a spike.
	SpikeMinRequests int64 `envconfig:"SPIKE_MIN_REQUESTS"`
	// SpikeWindow is the span of the denial rate.
	SpikeWindow time.Duration `envconfig:"SPIKE_WINDOW"`
	// EvalInterval is how often denial rates and bursts are evaluated.
	EvalInterval time.Duration `envconfig:"EVAL_INTERVAL" default:"5s"`
	// AbuseBurst denials of one subject or IP within AbuseWindow raise
	// quota.abuse_suspected.
	AbuseBurst int64 `envconfig:"ABUSE_BURST"`
	// AbuseWindow is the span of an abuse burst.
	AbuseWindow time.Duration `envconfig:"ABUSE_WINDOW"`
	// TopTenants is how many tenants (those nearest a tenant-scope token
	// limit) the top-tenant gauges show: a label per tenant, so keep it
	// small.
	TopTenants int `envconfig:"TOP_TENANTS"`

	// DeliveryTimeout bounds one webhook attempt.
	DeliveryTimeout time.Duration `envconfig:"DELIVERY_TIMEOUT"`
	// DeliveryMinBackoff is the delay after a first failed attempt; it
	// doubles per attempt, with jitter.
	DeliveryMinBackoff time.Duration `envconfig:"DELIVERY_MIN_BACKOFF"`
	// DeliveryMaxBackoff caps the delay between attempts.
	DeliveryMaxBackoff time.Duration `envconfig:"DELIVERY_MAX_BACKOFF"`
	// DeliveryMaxAge is how long a delivery is retried before it is dead.
	DeliveryMaxAge time.Duration `envconfig:"DELIVERY_MAX_AGE"`
	// DeliveryPoll is how often the outbox is polled for due retries.
	DeliveryPoll time.Duration `envconfig:"DELIVERY_POLL"`
	// OutboxRetention is how long delivered and dead deliveries, the log
	// of recent alerts, stay in the outbox.
	OutboxRetention time.Duration `envconfig:"OUTBOX_RETENTION"`

	// ShutdownTimeout bounds each step of the graceful shutdown.
	ShutdownTimeout time.Duration `envconfig:"SHUTDOWN_TIMEOUT" default:"10s"`
}

// defaults is Config before the environment is read: the defaults other
// packages own (the package that uses a setting owns its default).
// envconfig keeps them where a variable is unset.
func defaults() Config {
	return Config{
		NATS: config.DefaultNATS, Postgres: config.DefaultPostgres, Log: config.DefaultLog,
		Hysteresis: detect.DefaultHysteresis, SpikeRate: detect.DefaultSpikeRate,
		SpikeMinRequests: detect.DefaultSpikeMinRequests, SpikeWindow: detect.DefaultSpikeWindow,
		AbuseBurst: detect.DefaultAbuseBurst, AbuseWindow: detect.DefaultAbuseWindow, TopTenants: detect.DefaultTopTenants,
		DeliveryTimeout: deliver.DefaultAttemptTimeout, DeliveryMinBackoff: deliver.DefaultMinBackoff,
		DeliveryMaxBackoff: deliver.DefaultMaxBackoff, DeliveryMaxAge: deliver.DefaultMaxAge,
		DeliveryPoll: deliver.DefaultPoll, OutboxRetention: deliver.DefaultRetention,
		Ops: obs.Ops{HeapFloorBytes: obs.HeapFloorConsumers},
	}
}

// Validate checks the URLs, the cross-field rules and ranges.
func (c Config) Validate() error {
	errs := []error{c.NATS.Validate(), c.Postgres.Validate(), c.Log.Validate()}
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if _, port, err := net.SplitHostPort(c.AlertsAddr); err != nil {
		bad("QF_ALERTS_ADDR %q: want host:port or :port", c.AlertsAddr)
	} else if c.AlertsAddr == c.OpsAddr && port != "0" { // port 0: each its own free port
		bad("QF_ALERTS_ADDR: must differ from QF_OPS_ADDR")
	}
	errs = append(errs, c.Tokens.Validate())
	if c.Consumer == "" {
		bad("QF_CONSUMER: required")
	}
	if c.Hysteresis <= 0 || c.Hysteresis >= 80 { // detect takes a 0 for its default
		bad("QF_ALERT_HYSTERESIS %v: want more than 0 to under 80 percentage points", c.Hysteresis)
	}
	if c.SpikeRate <= 0 || c.SpikeRate >= 1 {
		bad("QF_SPIKE_RATE %v: want a rate between 0 and 1", c.SpikeRate)
	}
	if c.SpikeMinRequests < 1 {
		bad("QF_SPIKE_MIN_REQUESTS %d: want at least 1", c.SpikeMinRequests)
	}
	if c.AbuseBurst < 1 {
		bad("QF_ABUSE_BURST %d: want at least 1", c.AbuseBurst)
	}
	if c.TopTenants < 1 || c.TopTenants > 100 {
		bad("QF_TOP_TENANTS %d: want 1 to 100", c.TopTenants)
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{
		{"QF_SPIKE_WINDOW", c.SpikeWindow}, {"QF_EVAL_INTERVAL", c.EvalInterval}, {"QF_ABUSE_WINDOW", c.AbuseWindow},
		{"QF_DELIVERY_TIMEOUT", c.DeliveryTimeout}, {"QF_DELIVERY_MIN_BACKOFF", c.DeliveryMinBackoff},
		{"QF_DELIVERY_MAX_BACKOFF", c.DeliveryMaxBackoff}, {"QF_DELIVERY_MAX_AGE", c.DeliveryMaxAge},
		{"QF_DELIVERY_POLL", c.DeliveryPoll}, {"QF_SHUTDOWN_TIMEOUT", c.ShutdownTimeout},
	} {
		if d.v <= 0 {
			bad("%s %v: want a positive duration", d.name, d.v)
		}
	}
	if c.OutboxRetention <= c.DeliveryMaxAge { // an alert's rows go together, once none is pending
		bad("QF_OUTBOX_RETENTION %v: want longer than QF_DELIVERY_MAX_AGE %v", c.OutboxRetention, c.DeliveryMaxAge)
	}
	if c.DeliveryMinBackoff > c.DeliveryMaxBackoff {
		bad("QF_DELIVERY_MIN_BACKOFF %v is longer than QF_DELIVERY_MAX_BACKOFF %v", c.DeliveryMinBackoff, c.DeliveryMaxBackoff)
	}
	if c.EvalInterval > c.SpikeWindow {
		bad("QF_EVAL_INTERVAL %v is longer than QF_SPIKE_WINDOW %v", c.EvalInterval, c.SpikeWindow)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("alerter config: %w", err)
	}
	return nil
}

// LogArgs are the settings the "starting" line shows, without secrets.
func (c Config) LogArgs() []any {
	return slices.Concat([]any{"ops_addr", c.OpsAddr, "pprof", c.Pprof, "heap_floor_bytes", c.HeapFloorBytes, "alerts_addr", c.AlertsAddr, "api_tokens_file", c.APITokensFile}, c.Postgres.LogArgs(), c.NATS.LogArgs(),
		[]any{"consumer", c.Consumer, "webhooks_file", c.WebhooksFile, "policy_file", c.PolicyFile})
}

func (c Config) deliverOptions() deliver.Options {
	return deliver.Options{
		AttemptTimeout: c.DeliveryTimeout, MinBackoff: c.DeliveryMinBackoff, MaxBackoff: c.DeliveryMaxBackoff,
		MaxAge: c.DeliveryMaxAge, Poll: c.DeliveryPoll, Retention: c.OutboxRetention,
	}
}

func (c Config) detectOptions() detect.Options {
	return detect.Options{
		Hysteresis: c.Hysteresis, SpikeWindow: c.SpikeWindow, SpikeRate: c.SpikeRate,
		SpikeMinRequests: c.SpikeMinRequests, AbuseWindow: c.AbuseWindow, AbuseBurst: c.AbuseBurst,
		TopTenants: c.TopTenants,
	}
}
