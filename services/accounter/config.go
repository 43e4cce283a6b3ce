package main

import (
	"errors"
	"fmt"
	"net/url"
	"time"

	"quotaflow/internal/obs"
	"quotaflow/pkg/events/stream"
)

// Config is the accounter's configuration, read from QF_* environment
// variables by envconfig (prefix QF); the tags hold the defaults. Validate
// checks it.
type Config struct {
	RedisURL    string `envconfig:"REDIS_URL" default:"redis://127.0.0.1:6379/0"`
	PostgresURL string `envconfig:"POSTGRES_URL" default:"postgres://postgres@127.0.0.1:5432/quotaflow?sslmode=disable"`
	NATSURL     string `envconfig:"NATS_URL" default:"nats://127.0.0.1:4222"`
	PolicyFile  string `envconfig:"POLICY_FILE" default:"deploy/policy.yaml"`
	// Config names the streams and the consumer's redelivery: QF_STREAM,
	// QF_SUBJECT_PREFIX, QF_DLQ_STREAM, QF_STREAM_MAX_AGE,
	// QF_STREAM_DUPLICATES, QF_DLQ_MAX_AGE, QF_STREAM_REPLICAS,
	// QF_MAX_DELIVER, QF_ACK_WAIT.
	stream.Config
	LogLevel string `envconfig:"LOG_LEVEL" default:"info"`
	OpsAddr  string `envconfig:"OPS_ADDR" default:":9091"`
	// Ops holds the ops port's other settings: QF_PPROF.
	obs.Ops

	// Durable is the consumer's durable name; every accounter instance
	// shares it to split the stream.
	Durable string `envconfig:"DURABLE" default:"accounter"`
	// Workers is how many batches one instance handles at once.
	Workers int `envconfig:"WORKERS" default:"4"`
	// BatchSize and BatchWait bound a fetch: at most BatchSize messages,
	// waiting at most BatchWait for them.
	BatchSize int           `envconfig:"BATCH_SIZE" default:"500"`
	BatchWait time.Duration `envconfig:"BATCH_WAIT" default:"200ms"`
	// ReservationTTL is how long a reservation waits for its actual event
	// before the expiry task settles it; the same value as admission's
	// QF_RESERVATION_TTL, and at least QF_STREAM_MAX_AGE.
	ReservationTTL time.Duration `envconfig:"RESERVATION_TTL" default:"24h"`
	// SettleExpiredAtEstimate settles an expired reservation at its
	// estimate (Redis keeps counting it); false gives the estimate back.
	SettleExpiredAtEstimate bool `envconfig:"SETTLE_EXPIRED_AT_ESTIMATE" default:"true"`
	// ExpiryInterval is how often the expiry task runs.
	ExpiryInterval time.Duration `envconfig:"EXPIRY_INTERVAL" default:"1m"`
	// EpochInterval is how often Redis is checked for lost data (its epoch
	// key); each check reads 16384 small keys in 16 pipelines.
	EpochInterval time.Duration `envconfig:"EPOCH_INTERVAL" default:"5s"`
	// ReconcileInterval is how often Redis's token windows are compared
	// with the ledger (quotaflow_accounter_drift_*); 0 turns it off.
	ReconcileInterval time.Duration `envconfig:"RECONCILE_INTERVAL" default:"10m"`
	// ReconcileRepair repairs the drift that two consecutive comparisons
	// find unchanged while no event is in flight
	// (quotaflow_accounter_repaired_tokens_total); false only measures.
	ReconcileRepair bool `envconfig:"RECONCILE_REPAIR" default:"true"`
	// ShutdownTimeout bounds the graceful shutdown on SIGTERM.
	ShutdownTimeout time.Duration `envconfig:"SHUTDOWN_TIMEOUT" default:"15s"`
}

// Validate checks every field and returns all problems at once, each
// naming its variable. It never repeats a URL's password.
func (c *Config) Validate() error {
	var errs []error
	bad := func(v, format string, args ...any) {
		errs = append(errs, fmt.Errorf("QF_%s: %s", v, fmt.Sprintf(format, args...)))
	}
	for _, u := range []struct{ name, v, want string }{
		{"REDIS_URL", c.RedisURL, "redis://host:6379/0"},
		{"POSTGRES_URL", c.PostgresURL, "postgres://user@host:5432/db"},
		{"NATS_URL", c.NATSURL, "nats://host:4222"},
	} {
		if pu, err := url.Parse(u.v); err != nil || pu.Host == "" {
			bad(u.name, "want a URL like %s", u.want)
		}
	}
	if c.PolicyFile == "" {
		bad("POLICY_FILE", "required")
	}
	if err := c.Config.Validate(); err != nil {
		errs = append(errs, err)
	}
	if _, err := obs.ParseLevel(c.LogLevel); err != nil {
		bad("LOG_LEVEL", "%v", err)
	}
	if c.OpsAddr == "" {
		bad("OPS_ADDR", "required")
	}
	if c.Durable == "" {
		bad("DURABLE", "required")
	}
	if c.Workers < 1 || c.Workers > 256 {
		bad("WORKERS", "%d: want 1 to 256", c.Workers)
	}
	if c.BatchSize < 1 || c.BatchSize > 10000 {
		bad("BATCH_SIZE", "%d: want 1 to 10000", c.BatchSize)
	}
	if c.BatchWait <= 0 {
		bad("BATCH_WAIT", "must be positive")
	}
	if c.ReservationTTL <= 0 {
		bad("RESERVATION_TTL", "must be positive")
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"EXPIRY_INTERVAL", c.ExpiryInterval}, {"EPOCH_INTERVAL", c.EpochInterval}, {"SHUTDOWN_TIMEOUT", c.ShutdownTimeout}} {
		if d.v <= 0 {
			bad(d.name, "must be positive")
		}
	}
	if c.ReconcileInterval < 0 {
		bad("RECONCILE_INTERVAL", "must not be negative (0 turns it off)")
	}
	return errors.Join(errs...)
}

// Level is the log level, for service.Main.
func (c *Config) Level() string { return c.LogLevel }
