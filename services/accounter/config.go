package main

import (
	"errors"
	"fmt"
	"net"
	"slices"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"quotaflow/internal/alertlog"
	"quotaflow/internal/auth"
	"quotaflow/internal/config"
	"quotaflow/internal/obs"
	"quotaflow/internal/server"
	"quotaflow/pkg/limits"
	"quotaflow/services/accounter/internal/consume"
	"quotaflow/services/accounter/internal/expire"
	"quotaflow/services/accounter/internal/history"
	"quotaflow/services/accounter/internal/ledger"
	"quotaflow/services/accounter/internal/retention"
)

// Config is the accounter's configuration, read from QF_* environment
// variables by envconfig (prefix QF) over defaults(): the tags hold the
// defaults of the settings only the accounter's main uses, the packages
// that use the others own theirs (defaults). Validate checks it.
type Config struct {
	config.Redis    // QF_REDIS_URL
	config.Postgres // QF_POSTGRES_URL: the ledger
	config.NATS     // QF_NATS_URL, the streams and the consumer's redelivery
	config.Policy   // QF_POLICY_FILE
	config.Log      // QF_LOG_LEVEL
	// OpsAddr is where /metrics, /healthz and /readyz listen.
	OpsAddr string `envconfig:"OPS_ADDR" default:":9091"`
	// Ops holds the ops port's other settings: QF_PPROF.
	obs.Ops
	// ConsoleAddr is where the console and its usage API listen (package
	// history). Without a token configured it listens on loopback only: its
	// host is replaced by 127.0.0.1, with a warning.
	ConsoleAddr string `envconfig:"CONSOLE_ADDR" default:":8081"`
	// Tokens are QF_API_TOKENS and QF_API_TOKENS_FILE, admission's tokens.
	auth.Tokens
	// AlerterURL is the alerter's alerts API (its QF_ALERTS_ADDR), which
	// the console's alerts and GET /v1/alerts read, with the viewer's own
	// token, when set; empty reads the alerter's outbox in the ledger's
	// database (503 when it is elsewhere).
	AlerterURL string `envconfig:"ALERTER_URL"`
	// AlerterTimeout bounds one request to AlerterURL.
	AlerterTimeout time.Duration `envconfig:"ALERTER_TIMEOUT"`
	// ConsoleDBConns is the size of the console's own pool of the
	// ledger's database, for the reads of its pages and usage API: at most
	// that many run at once, the others wait for a connection, and none
	// takes one of the consumer's (poolSize). Default history.DefaultConns.
	ConsoleDBConns int `envconfig:"CONSOLE_DB_CONNS"`
	// ConsoleQueryTimeout bounds one such read, its wait for a connection
	// included (503 past it); Postgres ends a statement running longer
	// (its statement_timeout); under the console server's write timeout
	// (server.WriteTimeout), or the 503 would not reach the client. Default
	// history.DefaultQueryTimeout.
	ConsoleQueryTimeout time.Duration `envconfig:"CONSOLE_QUERY_TIMEOUT"`

	// Durable is the consumer's durable name; every accounter instance
	// shares it to split the stream.
	Durable string `envconfig:"DURABLE" default:"accounter"`
	// Workers is how many batches one instance handles at once.
	Workers int `envconfig:"WORKERS"`
	// BatchSize bounds a fetch's messages and a batch's events; a fetch
	// takes what came over at least BatchWait since the last one, unless
	// that one left a backlog.
	BatchSize int           `envconfig:"BATCH_SIZE"`
	BatchWait time.Duration `envconfig:"BATCH_WAIT"`
	// ReservationTTL is how long a reservation waits for its actual event
	// before the expiry task settles it; the same value as admission's
	// QF_RESERVATION_TTL, and at least QF_STREAM_MAX_AGE. Default
	// limits.DefaultReservationTTL.
	ReservationTTL time.Duration `envconfig:"RESERVATION_TTL"`
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
	ShutdownTimeout time.Duration `envconfig:"SHUTDOWN_TIMEOUT"`
	// LedgerPartitionDays is the width, in days, of the ledger's time
	// partitions created from now on. Default ledger.DefaultPartitionDays.
	LedgerPartitionDays int `envconfig:"LEDGER_PARTITION_DAYS"`
	// LedgerRetentionDays is how many days of the ledger the retention
	// keeps (whole partitions older are dropped); 0 keeps everything. At
	// least retention.Floor of a calendar month and the reservation TTL;
	// the retention task refuses it while the policy in force holds a
	// longer window. Default retention.DefaultDays.
	LedgerRetentionDays int `envconfig:"LEDGER_RETENTION_DAYS"`
}

// defaults is Config before the environment is read: the defaults other
// packages own. envconfig keeps them where a variable is unset.
func defaults() Config {
	return Config{
		Redis: config.DefaultRedis, Postgres: config.DefaultPostgres, NATS: config.DefaultNATS,
		Policy: config.DefaultPolicy, Log: config.DefaultLog,
		Workers: consume.DefaultWorkers, BatchSize: consume.DefaultBatchSize, BatchWait: consume.DefaultBatchWait,
		ReservationTTL:  limits.DefaultReservationTTL,
		ShutdownTimeout: config.DefaultShutdownTimeout, AlerterTimeout: alertlog.DefaultTimeout,
		ConsoleDBConns: history.DefaultConns, ConsoleQueryTimeout: history.DefaultQueryTimeout,
		LedgerPartitionDays: ledger.DefaultPartitionDays, LedgerRetentionDays: retention.DefaultDays,
		Ops: obs.Ops{HeapFloorBytes: obs.HeapFloorConsumers},
	}
}

// Validate checks every field and returns all problems at once, each
// naming its variable. It never repeats a URL's password.
func (c *Config) Validate() error {
	var errs []error
	bad := func(v, format string, args ...any) {
		errs = append(errs, fmt.Errorf("QF_%s: %s", v, fmt.Sprintf(format, args...)))
	}
	errs = append(errs, c.Redis.Validate(), c.Postgres.Validate(), c.NATS.Validate(), c.Policy.Validate(), c.Log.Validate())
	if c.OpsAddr == "" {
		bad("OPS_ADDR", "required")
	}
	if _, _, err := net.SplitHostPort(c.ConsoleAddr); err != nil {
		bad("CONSOLE_ADDR", "want host:port or :port")
	} else if c.ConsoleAddr == c.OpsAddr {
		bad("CONSOLE_ADDR", "must differ from QF_OPS_ADDR")
	}
	errs = append(errs, c.Tokens.Validate())
	if c.AlerterURL != "" {
		if err := alertlog.CheckURL(c.AlerterURL); err != nil {
			bad("ALERTER_URL", "%v", err)
		}
	}
	if c.ConsoleDBConns < 1 || c.ConsoleDBConns > 100 {
		bad("CONSOLE_DB_CONNS", "%d: want 1 to 100", c.ConsoleDBConns)
	}
	if c.ConsoleQueryTimeout < time.Millisecond || c.ConsoleQueryTimeout >= server.WriteTimeout {
		// Past the server's write timeout the 503 would never reach the client.
		bad("CONSOLE_QUERY_TIMEOUT", "%v: want 1ms to under %v", c.ConsoleQueryTimeout, server.WriteTimeout)
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
	}{{"EXPIRY_INTERVAL", c.ExpiryInterval}, {"EPOCH_INTERVAL", c.EpochInterval}, {"SHUTDOWN_TIMEOUT", c.ShutdownTimeout},
		{"ALERTER_TIMEOUT", c.AlerterTimeout}} {
		if d.v <= 0 {
			bad(d.name, "must be positive")
		}
	}
	if c.LedgerPartitionDays < 1 || c.LedgerPartitionDays > 366 {
		bad("LEDGER_PARTITION_DAYS", "%d: want 1 to 366", c.LedgerPartitionDays)
	}
	if floor := retention.Floor(0, c.ReservationTTL) / retention.Day; c.LedgerRetentionDays != 0 && c.LedgerRetentionDays < int(floor) {
		bad("LEDGER_RETENTION_DAYS", "%d: want 0 (keep everything) or at least %d (a calendar month and two QF_RESERVATION_TTL)", c.LedgerRetentionDays, floor)
	}
	// A late event of a request whose key the retention pruned makes a new
	// row, charging a prepaid balance again: every event must come before
	// then, from the stream or replayed from the dead letters.
	if late := c.MaxAge + c.DLQMaxAge + retention.Day; c.LedgerRetentionDays != 0 && time.Duration(c.LedgerRetentionDays)*retention.Day < late {
		bad("DLQ_MAX_AGE", "%v: with QF_STREAM_MAX_AGE %v, a dead letter replayed at the end of its age is %d days or more after its request was first written: want QF_LEDGER_RETENTION_DAYS (%d) at least that, or 0", c.DLQMaxAge, c.MaxAge, int((late+retention.Day-1)/retention.Day), c.LedgerRetentionDays)
	}
	if c.ReconcileInterval < 0 {
		bad("RECONCILE_INTERVAL", "must not be negative (0 turns it off)")
	}
	return errors.Join(errs...)
}

// LogArgs are the settings the "starting" line shows, without secrets.
func (c Config) LogArgs() []any {
	return slices.Concat([]any{"ops_addr", c.OpsAddr, "pprof", c.Pprof, "heap_floor_bytes", c.HeapFloorBytes, "console_addr", c.ConsoleAddr, "api_tokens_file", c.APITokensFile,
		"alerter_url", c.AlerterURL, "console_db_conns", c.ConsoleDBConns, "console_query_timeout", c.ConsoleQueryTimeout.String()},
		c.Policy.LogArgs(), c.Redis.LogArgs(), c.Postgres.LogArgs(), c.NATS.LogArgs(), []any{
			"durable", c.Durable, "workers", c.Workers, "batch_size", c.BatchSize, "batch_wait", c.BatchWait.String(),
			"reservation_ttl", c.ReservationTTL.String(), "settle_expired_at_estimate", c.SettleExpiredAtEstimate,
			"reconcile_interval", c.ReconcileInterval.String(), "reconcile_repair", c.ReconcileRepair,
			"ledger_partition_days", c.LedgerPartitionDays, "ledger_retention_days", c.LedgerRetentionDays})
}

// poolSize lets each worker hold a connection for its batch's
// transaction, while a rebuild and a repair each hold a lock's connection
// and read the ledger on another, and the expiry task needs one. The
// console reads on a pool of its own (consolePool).
func (c Config) poolSize(pc *pgxpool.Config) {
	pc.MaxConns = max(pc.MaxConns, int32(c.Workers)+5)
}

// consolePool is the console's own pool of the ledger's database.
func (c Config) consolePool() history.PoolOptions {
	return history.PoolOptions{Conns: c.ConsoleDBConns, QueryTimeout: c.ConsoleQueryTimeout}
}

// limitsOptions are the engine's and the repair tools' options: the same
// reservation TTL for both.
func (c Config) limitsOptions() limits.Options {
	return limits.Options{ReservationTTL: c.ReservationTTL}
}

func (c Config) retentionOptions() retention.Options {
	return retention.Options{PartitionDays: c.LedgerPartitionDays, RetentionDays: c.LedgerRetentionDays, TTL: c.ReservationTTL}
}

func (c Config) expireOptions() expire.Options {
	return expire.Options{TTL: c.ReservationTTL, AtEstimate: c.SettleExpiredAtEstimate}
}

func (c Config) consumeOptions(beforeAck func(int) error) consume.Options {
	return consume.Options{Events: c.Config, Workers: c.Workers, BatchSize: c.BatchSize, BatchWait: c.BatchWait,
		Source: source, BeforeAck: beforeAck}
}
