package config

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"quotaflow/pkg/events/stream"
)

func TestRedacted(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"},
		{"redis://u:hunter2@h:6379/0", "redis://u:xxxxx@h:6379/0"},
		{"rediss://:hunter2@h:6379/0?master_name=m&sentinel_password=hunter2", "rediss://:xxxxx@h:6379/0?master_name=m&sentinel_password=xxxxx"},
		{"postgres://postgres@h:5432/q?sslmode=disable", "postgres://postgres@h:5432/q?sslmode=disable"},
		{"postgres://u@h/q?password=hunter2", "postgres://u@h/q?password=xxxxx"},
		{"nats://hunter2@h:4222", "nats://xxxxx@h:4222"},
		{"nats://u:hunter2@a:4222, nats://b:4222", "nats://u:xxxxx@a:4222,nats://b:4222"},
		{"host=h user=u password=hunter2", "(not a url)"},
		{"::", "(not a url)"},
	} {
		got := Redacted(tc.in)
		if got != tc.want || strings.Contains(got, "hunter2") {
			t.Errorf("Redacted(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

func TestDefaultsAreValid(t *testing.T) {
	for _, p := range []interface{ Validate() error }{DefaultRedis, DefaultPostgres, DefaultNATS, DefaultPolicy, DefaultLog} {
		if err := p.Validate(); err != nil {
			t.Errorf("%T.Validate() = %v", p, err)
		}
	}
}

func TestValidateNamesTheVariable(t *testing.T) {
	for _, tc := range []struct {
		part interface{ Validate() error }
		want string
	}{
		{Redis{RedisURL: "redis://:hunter2@"}, "QF_REDIS_URL"},
		{Postgres{PostgresURL: "host=h password=hunter2"}, "QF_POSTGRES_URL"},
		{NATS{NATSURL: "127.0.0.1:4222"}, "QF_NATS_URL"},
		{Policy{}, "QF_POLICY_FILE"},
		{Log{LogLevel: "loud"}, "QF_LOG_LEVEL"},
		// The stream settings' own checks name the variable too...
		{natsWith(func(c *stream.Config) { c.Replicas = 7 }), "QF_STREAM_REPLICAS 7: want 1 to 5"},
		{natsWith(func(c *stream.Config) { c.Compression = "gzip" }), `QF_EVENT_COMPRESSION "gzip"`},
		{natsWith(func(c *stream.Config) { c.Duplicates = 48 * time.Hour }), "QF_STREAM_DUPLICATES 48h0m0s is longer than QF_STREAM_MAX_AGE 24h0m0s"},
		// ...and one set to 0 or empty, which the stream package would
		// silently take for its default, is refused.
		{natsWith(func(c *stream.Config) { c.Replicas = 0 }), "QF_STREAM_REPLICAS 0: must be positive (unset, it is 1)"},
		{natsWith(func(c *stream.Config) { c.MaxDeliver = 0 }), "QF_MAX_DELIVER 0: must be positive"},
		{natsWith(func(c *stream.Config) { c.MaxAge = 0 }), "QF_STREAM_MAX_AGE 0s: must be positive (unset, it is 24h)"},
		{natsWith(func(c *stream.Config) { c.AckWait = 0 }), "QF_ACK_WAIT 0s: must be positive"},
		{natsWith(func(c *stream.Config) { c.Stream = "" }), `QF_STREAM "": required (unset, it is QUOTAFLOW_USAGE)`},
		{natsWith(func(c *stream.Config) { c.Compression = "" }), `QF_EVENT_COMPRESSION "": required`},
	} {
		err := tc.part.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "hunter2") {
			t.Errorf("%T.Validate() = %v, want an error naming %s and no password", tc.part, err, tc.want)
		}
	}
}

// natsWith is DefaultNATS with edit applied to its stream settings.
func natsWith(edit func(*stream.Config)) NATS {
	n := DefaultNATS
	edit(&n.Config)
	return n
}

func TestURLsFromTheEnvironment(t *testing.T) {
	t.Setenv("QF_REDIS_URL", "")
	t.Setenv("QF_NATS_URL", "nats://elsewhere:4222")
	if got := RedisURL(); got != DefaultRedisURL {
		t.Errorf("RedisURL() with QF_REDIS_URL empty = %q, want the default", got)
	}
	if got := NATSURL(); got != "nats://elsewhere:4222" {
		t.Errorf("NATSURL() = %q, want QF_NATS_URL's", got)
	}
}

// The parts' LogArgs, which every service's starting line is made of,
// show no password or token.
func TestPartsLogNoSecrets(t *testing.T) {
	n := NATS{NATSURL: "nats://tok3n@nats:4222"}
	args := [][]any{
		Redis{RedisURL: "redis://u:s3cret@redis:6379/0"}.LogArgs(),
		Postgres{PostgresURL: "postgres://u:s3cret@pg/db?sslmode=disable"}.LogArgs(),
		n.LogArgs(),
	}
	for _, a := range args {
		s := fmt.Sprint(a...)
		if strings.Contains(s, "s3cret") || strings.Contains(s, "tok3n") || !strings.Contains(s, "xxxxx") {
			t.Errorf("LogArgs %q: want the secret masked", s)
		}
	}
}
