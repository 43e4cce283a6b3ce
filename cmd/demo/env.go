package main

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"

	"quotaflow/internal/e2e"
	"quotaflow/internal/pgdb"
)

// names are this run's own resources on the shared servers: several demos
// (and the test suite) may use the same Redis, Postgres and NATS at once.
type names struct {
	run       string   // random hex, in every name below
	tenants   []string // Redis keys carry the tenant's hash tag
	llmTenant string   // the LLM gateway's caller (a tenant of its own)
	llmKey    string   // its API key at the gateway
	stream    string
	dlq       string
	durable   string // the accounter's consumer on stream
	prefix    string
	database  string
	token     string // admission's bearer token
	console   string // the console's admin token
	tenantC   string // a console token bound to tenants[0]: what a tenant sees
	whSecret  string // "whsec_" + base64 key
	endpoint  string
	planName  string
	quota5h   int64
	dailyReqs int64
}

func newNames() names { return namesFor(e2e.RandomHex(4)) }

// namesFor derives every name from the run id (secrets aside), so that
// -cleanup can find a kept run's resources.
func namesFor(run string) names {
	up := strings.ToUpper(run)
	n := names{
		run:       run,
		stream:    "QFDEMO_" + up,
		dlq:       "QFDEMO_" + up + "_DLQ",
		durable:   "accounter-" + run,
		prefix:    "qfdemo_" + run,
		database:  "qfdemo_" + run,
		token:     "demo-" + e2e.RandomHex(16),
		console:   "demo-console-" + e2e.RandomHex(16),
		tenantC:   "demo-tenant-" + e2e.RandomHex(16),
		llmTenant: "demo-" + run + "-llm",
		llmKey:    "demo-llm-" + e2e.RandomHex(16),
		endpoint:  "/v1/chat",
		planName:  "demo",
		quota5h:   30000,
		dailyReqs: 100,
	}
	n.whSecret = e2e.NewWebhookSecret()
	for _, t := range []string{"acme", "globex", "initech"} {
		n.tenants = append(n.tenants, "demo-"+run+"-"+t)
	}
	return n
}

// consoleTokens is the accounter's QF_API_TOKENS: the admin's token and
// the one bound to tenants[0].
func (n names) consoleTokens() string {
	return n.console + "#admin," + n.tenantC + "@" + n.tenants[0]
}

// policy is the demo plan: a 5 h token quota small enough that the heavier
// users cross 80/90/100 % within the run, a request token bucket the
// hammering users run dry (alerting at nothing by default: it refills all
// day), and a per-user daily request limit on the endpoint. No global or IP limits: their counters would be shared with
// every other run on the same Redis.
func (n names) policy() string {
	return fmt.Sprintf(`# written by cmd/demo for run %s
default_plan: %s
plans:
  %s:
    quotas:
      - {name: 5h, kind: rolling, window: 5h,   limit: %d}
      - {name: 7d, kind: rolling, window: 168h, limit: %d}
    rates:
      - {name: rps, kind: token_bucket, rate: 10, per: 1s, burst: 20}
endpoints:
  %s:
    user: [{name: daily, kind: fixed, window: 24h, limit: %d}]
`, n.run, n.planName, n.planName, n.quota5h, n.quota5h*20, n.endpoint, n.dailyReqs)
}

// writeFiles writes the policy and webhooks files into dir.
func writeFiles(dir string, n names, hookURL string) (policy, hooks string, err error) {
	policy = filepath.Join(dir, "policy.yaml")
	hooks = filepath.Join(dir, "webhooks.yaml")
	if err = os.WriteFile(policy, []byte(n.policy()), 0o600); err != nil {
		return
	}
	err = os.WriteFile(hooks, []byte(e2e.Webhooks("demo-receiver", hookURL, n.whSecret)), 0o600)
	return
}

// databaseURL is base with the run's database name.
func databaseURL(base, db string) (string, error) {
	u, err := url.Parse(base)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return "", fmt.Errorf("QF_POSTGRES_URL: must be a postgres:// URL (not a key=value DSN)")
	}
	u.Path = "/" + db
	return u.String(), nil
}

// createDatabase creates the run's database up front, so a Postgres
// problem shows here rather than as a service failing to start.
func createDatabase(ctx context.Context, url string) error {
	cc, err := pgx.ParseConfig(url)
	if err != nil {
		return err
	}
	return pgdb.CreateDatabase(ctx, cc)
}

// dropDatabase drops the run's database (the services are stopped by now;
// FORCE ends any connection left over).
func dropDatabase(ctx context.Context, url string) error {
	cc, err := pgx.ParseConfig(url)
	if err != nil {
		return err
	}
	db := cc.Database
	cc.Database = "postgres"
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{db}.Sanitize()+" WITH (FORCE)")
	return err
}

// deleteStreams deletes the run's streams (their consumers go with them).
func deleteStreams(ctx context.Context, natsURL string, n names) error {
	nc, err := nats.Connect(natsURL, nats.Name("quotaflow-demo-cleanup"), nats.Timeout(5*time.Second))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	for _, s := range []string{n.stream, n.dlq} {
		if err := js.DeleteStream(ctx, s); err != nil && err != jetstream.ErrStreamNotFound {
			return fmt.Errorf("delete stream %s: %w", s, err)
		}
	}
	return nil
}

// deleteRedisKeys deletes every key of the run's tenants: they all carry
// the tenant's hash tag.
func deleteRedisKeys(ctx context.Context, redisURL string, n names) error {
	opt, err := redis.ParseURL(redisURL)
	if err != nil {
		return err
	}
	rdb := redis.NewClient(opt)
	defer rdb.Close()
	for _, t := range append([]string{n.llmTenant}, n.tenants...) {
		iter := rdb.Scan(ctx, 0, "*{"+t+"}*", 1000).Iterator()
		for iter.Next(ctx) {
			if err := rdb.Del(ctx, iter.Val()).Err(); err != nil {
				return err
			}
		}
		if err := iter.Err(); err != nil {
			return err
		}
	}
	return nil
}

// users: per tenant a light user (stays under 80 %), a medium one (crosses
// 80/90 %) and a heavy one (reaches the 5 h quota and gets 429s); two
// tenants also have a script hammering small requests, which runs the
// token bucket and the endpoint's daily limit dry.
func demoUsers(n names) []e2e.User {
	var us []e2e.User
	for i, t := range n.tenants {
		us = append(us,
			e2e.User{Tenant: t, Name: "light", Estimate: 200, Burst: 1},
			e2e.User{Tenant: t, Name: "medium", Estimate: 600, Burst: 1},
			e2e.User{Tenant: t, Name: "heavy", Estimate: 1000, Burst: 1})
		if i < 2 {
			us = append(us, e2e.User{Tenant: t, Name: "script", Estimate: 40, Burst: 12})
		}
	}
	return us
}
