package main

import (
	"strings"
	"testing"
	"time"

	"github.com/kelseyhightower/envconfig"
)

func TestConfigDefaultsAreValid(t *testing.T) {
	c := defaults()
	if err := envconfig.Process("QF_ACCOUNTER_TEST_NONE", &c); err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); err != nil {
		t.Fatalf("Validate(defaults) = %v", err)
	}
	if c.OpsAddr != ":9091" || c.PostgresURL != "postgres://postgres@127.0.0.1:5432/quotaflow?sslmode=disable" {
		t.Errorf("defaults: ops %q, postgres %q", c.OpsAddr, c.PostgresURL)
	}
	if !c.ReconcileRepair {
		t.Error("defaults: the reconciliation does not repair")
	}
	if c.Pprof {
		t.Error("defaults: QF_PPROF is on")
	}
	if c.HeapFloorBytes != 64<<20 {
		t.Errorf("defaults: QF_HEAP_FLOOR_BYTES %d, want 64 MiB", c.HeapFloorBytes)
	}
	if c.ConsoleDBConns != 4 || c.ConsoleQueryTimeout != 10*time.Second {
		t.Errorf("defaults: QF_CONSOLE_DB_CONNS %d, QF_CONSOLE_QUERY_TIMEOUT %v; want 4, 10s", c.ConsoleDBConns, c.ConsoleQueryTimeout)
	}
	c.AlerterURL = "https://alerter.internal:8082/"
	if err := c.Validate(); err != nil {
		t.Errorf("Validate(QF_ALERTER_URL %s) = %v", c.AlerterURL, err)
	}
}

func TestConfigValidate(t *testing.T) {
	base := defaults()
	if err := envconfig.Process("QF_ACCOUNTER_TEST_NONE", &base); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		edit func(*Config)
		want string
	}{
		{"postgres url", func(c *Config) { c.PostgresURL = "postgres://user:s3cret@" }, "QF_POSTGRES_URL"},
		{"batch size", func(c *Config) { c.BatchSize = 0 }, "QF_BATCH_SIZE"},
		{"console addr", func(c *Config) { c.ConsoleAddr = "8081" }, "QF_CONSOLE_ADDR: want host:port"},
		{"console on ops", func(c *Config) { c.ConsoleAddr = c.OpsAddr }, "QF_CONSOLE_ADDR: must differ"},
		{"tokens", func(c *Config) { c.APITokens = []string{"tok@"} }, "QF_API_TOKENS"},
		{"workers", func(c *Config) { c.Workers = 0 }, "QF_WORKERS"},
		{"ttl", func(c *Config) { c.ReservationTTL = 0 }, "QF_RESERVATION_TTL"},
		{"durable", func(c *Config) { c.Durable = "" }, "QF_DURABLE"},
		{"level", func(c *Config) { c.LogLevel = "loud" }, "QF_LOG_LEVEL"},
		{"alerter url scheme", func(c *Config) { c.AlerterURL = "ftp://alerter:8082" }, "QF_ALERTER_URL: want an http or https URL"},
		{"alerter url credentials", func(c *Config) { c.AlerterURL = "http://qf:s3cret@alerter:8082" }, "QF_ALERTER_URL: want no credentials"},
		{"alerter timeout", func(c *Config) { c.AlerterTimeout = 0 }, "QF_ALERTER_TIMEOUT: must be positive"},
		{"console db conns", func(c *Config) { c.ConsoleDBConns = 0 }, "QF_CONSOLE_DB_CONNS: 0: want 1 to 100"},
		{"console query timeout", func(c *Config) { c.ConsoleQueryTimeout = 0 }, "QF_CONSOLE_QUERY_TIMEOUT: 0s: want 1ms to under 30s"},
		{"console query timeout past the server's", func(c *Config) { c.ConsoleQueryTimeout = 30 * time.Second }, "QF_CONSOLE_QUERY_TIMEOUT: 30s: want 1ms to under 30s"},
		{"partition days", func(c *Config) { c.LedgerPartitionDays = 0 }, "QF_LEDGER_PARTITION_DAYS: 0: want 1 to 366"},
		{"retention under a month", func(c *Config) { c.LedgerRetentionDays = 30 }, "QF_LEDGER_RETENTION_DAYS: 30: want 0 (keep everything) or at least 33"},
		{"dead letters outliving the retention", func(c *Config) { c.LedgerRetentionDays, c.DLQMaxAge = 40, 40*24*time.Hour }, "QF_DLQ_MAX_AGE: 960h0m0s: with QF_STREAM_MAX_AGE 24h0m0s, a dead letter replayed at the end of its age is 42 days"},
		{"retention under the ttl's floor", func(c *Config) { c.LedgerRetentionDays, c.ReservationTTL = 38, 96*time.Hour }, "at least 39"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := base
			tc.edit(&c)
			err := c.Validate()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Validate() = %v, want an error naming %s", err, tc.want)
			}
			if strings.Contains(err.Error(), "s3cret") {
				t.Errorf("Validate() = %v: the error repeats a password", err)
			}
		})
	}
}
