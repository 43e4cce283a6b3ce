// Package config owns the settings that several quotaflow services read
// the same way (the servers' URLs, the policy file, the streams, the log
// level) with their QF_ variables and their defaults, written once here. A
// service's Config embeds the parts it uses, starts from their defaults and
// adds its own settings; the tools and tests that talk to the same servers
// read them here too (RedisURL, PostgresURL, NATSURL, PolicyFile).
//
// It imports only internal/obs and pkg/events/stream (for the stream settings).
package config

import (
	"errors"
	"fmt"
	"net/url"
	"os"
	"reflect"
	"time"

	"quotaflow/internal/obs"
	"quotaflow/pkg/events/stream"
)

// Defaults of the shared settings: the local servers of `go tool task
// deps` and the example policy, as README's configuration table lists them.
const (
	DefaultRedisURL    = "redis://127.0.0.1:6379/0"
	DefaultPostgresURL = "postgres://postgres@127.0.0.1:5432/quotaflow?sslmode=disable"
	DefaultNATSURL     = "nats://127.0.0.1:4222"
	DefaultPolicyFile  = "deploy/policy.yaml"
	DefaultLogLevel    = "info"
	// DefaultShutdownTimeout bounds each step of a graceful shutdown
	// (QF_SHUTDOWN_TIMEOUT) of admission and the accounter; the alerter's
	// steps, which only stop loops and drain NATS, have their own.
	DefaultShutdownTimeout = 15 * time.Second
)

// Redis is QF_REDIS_URL, for the services that keep limits in Redis.
type Redis struct {
	// RedisURL names one node, a Sentinel master or a Cluster (see
	// redisconn.Open).
	RedisURL string `envconfig:"REDIS_URL"`
}

// Postgres is QF_POSTGRES_URL, for the services that keep tables.
type Postgres struct {
	// PostgresURL is the service's database; it is created when absent.
	PostgresURL string `envconfig:"POSTGRES_URL"`
}

// NATS is QF_NATS_URL and the streams on that server, for every service.
type NATS struct {
	// NATSURL is the NATS server (JetStream enabled).
	NATSURL string `envconfig:"NATS_URL"`
	// Config names the streams and the consumers' redelivery: QF_STREAM,
	// QF_SUBJECT_PREFIX, QF_DLQ_STREAM, QF_STREAM_MAX_AGE,
	// QF_STREAM_DUPLICATES, QF_DLQ_MAX_AGE, QF_STREAM_REPLICAS,
	// QF_MAX_DELIVER, QF_ACK_WAIT, and the publishers' QF_EVENT_COMPRESSION;
	// their defaults are the stream package's.
	stream.Config
}

// Policy is QF_POLICY_FILE, for the services that enforce or repair limits.
type Policy struct {
	// PolicyFile is the policy YAML, reloaded on change and SIGHUP.
	PolicyFile string `envconfig:"POLICY_FILE"`
}

// Log is QF_LOG_LEVEL, for every service.
type Log struct {
	// LogLevel is debug, info, warn or error.
	LogLevel string `envconfig:"LOG_LEVEL"`
}

// LogArgs of each part are its settings for a service's "starting" line,
// URLs redacted: a service lists its parts' LogArgs and cannot forget to.
func (r Redis) LogArgs() []any { return []any{"redis_url", Redacted(r.RedisURL)} }

func (p Postgres) LogArgs() []any { return []any{"postgres_url", Redacted(p.PostgresURL)} }

func (n NATS) LogArgs() []any {
	return []any{"nats_url", Redacted(n.NATSURL), "stream", n.Stream, "subject_prefix", n.SubjectPrefix, "event_compression", n.Compression}
}

func (p Policy) LogArgs() []any { return []any{"policy_file", p.PolicyFile} }

// The parts at their defaults, for a service's Config to start from before
// envconfig reads the environment (envconfig keeps a field whose variable
// is unset and whose tag has no default).
var (
	DefaultRedis    = Redis{RedisURL: DefaultRedisURL}
	DefaultPostgres = Postgres{PostgresURL: DefaultPostgresURL}
	DefaultNATS     = NATS{NATSURL: DefaultNATSURL, Config: stream.Defaults()}
	DefaultPolicy   = Policy{PolicyFile: DefaultPolicyFile}
	DefaultLog      = Log{LogLevel: DefaultLogLevel}
)

// Validate checks that RedisURL is a URL with a host. Like every Validate
// here it names the variable and never repeats a password.
func (r Redis) Validate() error {
	return checkURL("REDIS_URL", r.RedisURL, "redis://host:6379/0")
}

// Validate checks that PostgresURL is a URL with a host (not a key=value
// DSN).
func (p Postgres) Validate() error {
	return checkURL("POSTGRES_URL", p.PostgresURL, "postgres://user@host:5432/db")
}

// Validate checks NATSURL and the stream settings. A service reads every
// stream setting, an unset variable taking its default, so a zero one was
// set to 0 or empty: it is refused, as the services refuse a 0 that means
// nothing, rather than taking the default unseen (stream.Config's zero
// fields do, for Go callers).
func (n NATS) Validate() error {
	errs := []error{checkURL("NATS_URL", n.NATSURL, "nats://host:4222"), n.Config.Validate()}
	v := reflect.ValueOf(n.Config)
	for i := range v.NumField() {
		f, fv := v.Type().Field(i), v.Field(i)
		if !fv.IsZero() {
			continue
		}
		want, shown := "must be positive", fmt.Sprint(fv.Interface())
		if fv.Kind() == reflect.String {
			want, shown = "required", `""`
		}
		errs = append(errs, fmt.Errorf("%s %s: %s (unset, it is %s)", stream.Env(f.Name), shown, want, f.Tag.Get("default")))
	}
	return errors.Join(errs...)
}

// Validate checks that a policy file is named; it is read at start, not
// here.
func (p Policy) Validate() error {
	if p.PolicyFile == "" {
		return errors.New("QF_POLICY_FILE: required")
	}
	return nil
}

// Validate checks the level's name.
func (l Log) Validate() error {
	if _, err := obs.ParseLevel(l.LogLevel); err != nil {
		return fmt.Errorf("QF_LOG_LEVEL: %w", err)
	}
	return nil
}

// Level is the log level, for service.Main.
func (l Log) Level() string { return l.LogLevel }

func checkURL(name, raw, like string) error {
	if u, err := url.Parse(raw); err != nil || u.Host == "" {
		return fmt.Errorf("QF_%s: want a URL like %s", name, like)
	}
	return nil
}

// RedisURL is the Redis the services would use here: QF_REDIS_URL, else
// the default. Tools and tests that share the services' servers read it
// (unlike envconfig, they take an empty variable as unset).
func RedisURL() string { return env("QF_REDIS_URL", DefaultRedisURL) }

// PostgresURL is the Postgres the services would use here:
// QF_POSTGRES_URL, else the default.
func PostgresURL() string { return env("QF_POSTGRES_URL", DefaultPostgresURL) }

// NATSURL is the NATS server the services would use here: QF_NATS_URL,
// else the default.
func NATSURL() string { return env("QF_NATS_URL", DefaultNATSURL) }

// PolicyFile is the policy the services would load here: QF_POLICY_FILE,
// else the default.
func PolicyFile() string { return env("QF_POLICY_FILE", DefaultPolicyFile) }

func env(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
