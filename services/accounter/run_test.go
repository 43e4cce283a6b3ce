package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"quotaflow/internal/config"
	"quotaflow/internal/e2e"
	"quotaflow/internal/eviction"
	"quotaflow/internal/natstest"
	"quotaflow/internal/obs"
	"quotaflow/internal/pgtest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
	"quotaflow/pkg/limits/repair"
	"quotaflow/services/accounter/internal/history"
)

// The integration tests run against the real Postgres and NATS of the
// development machine (QF_POSTGRES_URL, QF_NATS_URL override them) and a
// private redis-server each. Each test owns its database,
// stream, subject prefix and Redis.

const testPolicy = `
default_plan: free
plans:
  free:
    quotas:
      - {name: 5h,  kind: rolling, window: 5h,   limit: 100000}
      - {name: 30d, kind: rolling, window: 720h, limit: 1000000}
    rates:
      - {name: rps, kind: token_bucket, rate: 1000, per: 1s, burst: 1000}
  prepaid:
    quotas:
      - {name: 5h,      kind: rolling, window: 5h, limit: 100000}
      - {name: credits, kind: balance}
  rates:
    rates:
      - {name: hour, kind: fixed, window: 1h, limit: 1000}
tenants:
  prepaid: {plan: prepaid}
models:
  big-model: {input_weight: 1, output_weight: 3}
`

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

// env is one test's private world: database, Redis, stream and policy.
type env struct {
	t      testing.TB
	cfg    Config
	pg     *pgxpool.Pool
	redis  *redistest.Server
	lim    *limits.Limiter
	policy *policy.Policy
	js     jetstream.JetStream
	pub    *stream.Publisher
	ops    string               // the ops address of the last start
	reg    *prometheus.Registry // its metrics
}

func newEnv(t testing.TB) *env {
	t.Helper()

	// Postgres: a database of our own, dropped at the end.
	pgURL := pgtest.NewDatabase(t, "qf_accounter_test")

	// NATS: our own streams and prefix.
	nc, js := natstest.Connect(t, natstest.URL())
	ec := natstest.Streams(t, js, "acct", stream.Config{AckWait: 2 * time.Second, MaxDeliver: 5})

	policyFile := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(policyFile, []byte(testPolicy), 0o600); err != nil {
		t.Fatal(err)
	}
	pol, err := policy.Parse([]byte(testPolicy))
	if err != nil {
		t.Fatal(err)
	}
	rs := redistest.Start(t)

	e := &env{
		t: t, redis: rs, policy: pol, js: js, pub: stream.NewPublisher(js, ec),
		lim: limits.New(rs.Client(), limits.Options{ReservationTTL: time.Hour}),
		cfg: Config{
			Redis: config.Redis{RedisURL: "redis://" + rs.Addr + "/0"}, Postgres: config.Postgres{PostgresURL: pgURL},
			NATS: config.NATS{NATSURL: nc.ConnectedUrl(), Config: ec}, Policy: config.Policy{PolicyFile: policyFile},
			Log: config.Log{LogLevel: "info"}, OpsAddr: "127.0.0.1:0", ConsoleAddr: "127.0.0.1:0",
			ConsoleDBConns: history.DefaultConns, ConsoleQueryTimeout: history.DefaultQueryTimeout,
			Durable: "accounter", Workers: 2, BatchSize: 100, BatchWait: 50 * time.Millisecond,
			ReservationTTL: time.Hour, SettleExpiredAtEstimate: true,
			ExpiryInterval: 200 * time.Millisecond, EpochInterval: 200 * time.Millisecond,
			ReconcileInterval: 300 * time.Millisecond, ReconcileRepair: true,
			ShutdownTimeout: 5 * time.Second,
		},
	}
	return e
}

// start runs the accounter until the test ends (or stop is called) and
// waits until it is ready.
func (e *env) start(h *hooks) (stop func()) {
	t := e.t
	t.Helper()
	if h == nil {
		h = &hooks{}
	}
	addr := make(chan string, 1)
	var reg *prometheus.Registry
	h.started = func(ops string, r *prometheus.Registry) { reg = r; addr <- ops }
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	level, err := obs.ParseLevel(e.cfg.LogLevel)
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewJSONHandler(testWriter{t}, &slog.HandlerOptions{Level: level}))
	go func() { done <- run(ctx, e.cfg, log, *h) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("run: %v", err)
			}
		})
	}
	t.Cleanup(stop)
	var ops string
	select {
	case ops = <-addr:
	case err := <-done:
		t.Fatalf("run ended at start: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("run did not start")
	}
	e.ops, e.reg = ops, reg
	e2e.Eventually(t, "readyz 200", func() bool {
		code, _ := e2e.Readyz(ops)
		return code == 200
	})
	e.pgPool(t)
	return stop
}

// testAppName marks the test's own Postgres connections, which the
// connection-killing test spares.
const testAppName = "qf_accounter_test"

// pgPool returns the test's own pool of the accounter's database (which
// must exist), opening it on first use.
func (e *env) pgPool(t testing.TB) *pgxpool.Pool {
	if e.pg != nil {
		return e.pg
	}
	pc, err := pgxpool.ParseConfig(e.cfg.PostgresURL)
	if err != nil {
		t.Fatal(err)
	}
	pc.ConnConfig.RuntimeParams["application_name"] = testAppName
	pool, err := pgxpool.NewWithConfig(context.Background(), pc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	e.pg = pool
	return pool
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

var _ io.Writer = testWriter{}

// with returns a copy of e that reports to t (a subtest).
// waitEpoch waits until Redis holds the epoch: the accounter wrote it at
// start, or rewrote it after a rebuild.
func (e *env) waitEpoch(t *testing.T, what string) {
	t.Helper()
	e2e.Eventually(t, what, func() bool {
		missing, err := repair.EpochMissing(context.Background(), e.redis.Client())
		return err == nil && !missing
	})
}

// balance returns what Redis holds of the prepaid balance of tenant's
// user: the policy's "prepaid" plan's second rule.
func (e *env) balance(t *testing.T, tenant, user string) (credited, spent int64) {
	t.Helper()
	d, err := e.lim.Peek(context.Background(), limits.Request{Tenant: tenant, User: user, Rules: e.rules(tenant)})
	if err != nil {
		t.Fatal(err)
	}
	return d.States[1].Limit, d.States[1].Used
}

func (e *env) with(t *testing.T) *env {
	c := *e
	c.t = t
	return &c
}

func (e *env) rules(tenant string) []policy.Rule {
	r, err := e.policy.Resolve(tenant, "", "")
	if err != nil {
		e.t.Fatal(err)
	}
	return r.Subject
}

// reserve does what admission does for an admitted request: reserve in
// Redis and publish the reserved event (unless publish is false).
// reserve reserves est tokens for the request in Redis, as admission
// does, and returns its reserved event, published when publish is set.
func (e *env) reserve(tenant, user, req string, est int64, publish bool) events.Event {
	e.t.Helper()
	ctx := context.Background()
	d, err := e.lim.Reserve(ctx, limits.Request{Tenant: tenant, User: user, RequestID: req, Cost: est, Rules: e.rules(tenant)})
	if err != nil || !d.Allowed {
		e.t.Fatalf("Reserve(%s/%s %s) = %+v, %v", tenant, user, req, d, err)
	}
	ev := events.NewReserved("test/admission", events.Reserved{
		RequestID: req, Tenant: tenant, User: user, Endpoint: "/api/v1/generate",
		EstimatedTokens: est, ExpiresAt: time.Now().Add(time.Hour), Version: d.Version,
	}, time.Now())
	if publish {
		e.publish(ev)
	}
	return ev
}

func (e *env) actual(tenant, user, req, model string, in, out int64) events.Event {
	return events.NewActual("test/service", events.Actual{
		RequestID: req, Tenant: tenant, User: user, Model: model, InputTokens: in, OutputTokens: out,
	}, time.Now())
}

func (e *env) publish(ev events.Event) {
	e.t.Helper()
	if err := e.pub.Publish(context.Background(), ev); err != nil {
		e.t.Fatalf("publish: %v", err)
	}
}

// used returns the Used of the subject's token limit name.
// reservationKey is the Redis key of a reservation record (the layout of
// pkg/limits/internal/wire/keys.go, for names that need no escaping): tests
// delete it to play its TTL passing or Redis losing it.
func reservationKey(tenant, user, req string) string {
	return "q{" + tenant + "}r:" + user + ":" + req
}

func (e *env) used(tenant, user, name string) int64 {
	e.t.Helper()
	d, err := e.lim.Peek(context.Background(), limits.Request{Tenant: tenant, User: user, Rules: e.rules(tenant)})
	if err != nil {
		e.t.Fatalf("Peek(%s/%s): %v", tenant, user, err)
	}
	for _, s := range d.States {
		if s.Rule.Name == name {
			return s.Used
		}
	}
	e.t.Fatalf("no limit %s", name)
	return 0
}

func (e *env) count(q string, args ...any) int64 {
	e.t.Helper()
	var n int64
	if err := e.pg.QueryRow(context.Background(), q, args...).Scan(&n); err != nil {
		e.t.Fatalf("%s: %v", q, err)
	}
	return n
}

func (e *env) status(tenant, user, req string) string {
	var s string
	err := e.pg.QueryRow(context.Background(),
		"SELECT status FROM reservations WHERE tenant=$1 AND user_id=$2 AND request_id=$3", tenant, user, req).Scan(&s)
	if errors.Is(err, pgx.ErrNoRows) {
		return ""
	}
	if err != nil {
		e.t.Fatal(err)
	}
	return s
}

func (e *env) waitStatus(tenant, user, req, want string) {
	e.t.Helper()
	e2e.Eventually(e.t, fmt.Sprintf("reservation %s/%s %s %s", tenant, user, req, want), func() bool {
		return e.status(tenant, user, req) == want
	})
}

func (e *env) subjectMsgs(stream, subject string) uint64 {
	e.t.Helper()
	s, err := e.js.Stream(context.Background(), stream)
	if err != nil {
		e.t.Fatal(err)
	}
	info, err := s.Info(context.Background(), jetstream.WithSubjectFilter(subject))
	if err != nil {
		e.t.Fatal(err)
	}
	return info.State.Subjects[subject]
}

func TestAccounterEvents(t *testing.T) {
	base := newEnv(t)
	base.cfg.ReservationTTL = 3 * time.Second // the expiry subtest waits it out
	base.start(nil)
	ctx := context.Background()
	prefix := base.cfg.SubjectPrefix
	base.waitEpoch(t, "epoch written at start")

	t.Run("duplicate event under another Nats-Msg-Id", func(t *testing.T) {
		e := base.with(t)
		ten, usr, req := "dup-"+e2e.RandomHex(4), "u1", "r1"
		e.reserve(ten, usr, req, 100, true)
		ev := e.actual(ten, usr, req, "big-model", 30, 10) // 30 + 3*10 = 60
		e.publish(ev)
		raw, err := events.Encode(ev)
		if err != nil {
			t.Fatal(err)
		}
		m := nats.NewMsg(events.Subject(prefix, events.TypeActual))
		m.Data = raw
		m.Header.Set(jetstream.MsgIDHeader, "another-id-"+e2e.RandomHex(4))
		if _, err := e.js.PublishMsg(ctx, m); err != nil {
			t.Fatal(err)
		}
		e.waitStatus(ten, usr, req, "settled")
		// Let the second copy be consumed too.
		e2e.Eventually(t, "both copies consumed", func() bool {
			c, err := e.js.Consumer(ctx, e.cfg.Stream, e.cfg.Durable)
			if err != nil {
				return false
			}
			i, err := c.Info(ctx)
			return err == nil && i.NumPending == 0 && i.NumAckPending == 0
		})
		if n := e.count("SELECT count(*) FROM reservations WHERE convert_from(actual_event, 'UTF8')::jsonb->>'id' = $1", ev.ID); n != 1 {
			t.Errorf("reservations recording the actual = %d, want 1", n)
		}
		if got := e.used(ten, usr, "5h"); got != 60 {
			t.Errorf("5h used = %d, want 60 (corrected once)", got)
		}
		if n := e.count("SELECT tokens FROM usage_rollups WHERE tenant=$1", ten); n != 60 {
			t.Errorf("rollup tokens = %d, want 60", n)
		}
		// The corrected event was published by then (before the ack), once.
		if n := e.subjectMsgs(e.cfg.Stream, events.Subject(prefix, events.TypeCorrected)); n != 1 {
			t.Errorf("corrected events = %d, want 1", n)
		}
	})

	t.Run("actual before reserved", func(t *testing.T) {
		e := base.with(t)
		ten, usr, req := "early-"+e2e.RandomHex(4), "u1", "r1"
		e.reserve(ten, usr, req, 100, false)
		e.publish(e.actual(ten, usr, req, "", 30, 10)) // 40
		e.waitStatus(ten, usr, req, "settled")
		if got := e.used(ten, usr, "5h"); got != 40 {
			t.Errorf("5h used = %d, want 40", got)
		}
		e.publish(events.NewReserved("test/admission", events.Reserved{
			RequestID: req, Tenant: ten, User: usr, Endpoint: "/x", EstimatedTokens: 100,
			ExpiresAt: time.Now().Add(time.Hour), Version: 1,
		}, time.Now()))
		e2e.Eventually(t, "estimate recorded", func() bool {
			return e.count("SELECT coalesce(max(estimated_tokens), 0) FROM reservations WHERE tenant=$1", ten) == 100
		})
		if got, st := e.used(ten, usr, "5h"), e.status(ten, usr, req); got != 40 || st != "settled" {
			t.Errorf("after the late reserved: used %d, status %s; want 40, settled", got, st)
		}
	})

	t.Run("actual with no reservation", func(t *testing.T) {
		e := base.with(t)
		ten, usr, req := "none-"+e2e.RandomHex(4), "u1", "r1"
		e.publish(e.actual(ten, usr, req, "", 50, 20))
		e.waitStatus(ten, usr, req, "settled")
		if got := e.used(ten, usr, "5h"); got != 70 {
			t.Errorf("5h used = %d, want 70 (charged in full)", got)
		}
	})

	t.Run("decided without Redis", func(t *testing.T) {
		// Admission's local mode reserves nothing in Redis and publishes
		// version 0: the actual is charged in full, a release gives
		// nothing back, although the ledger holds an estimate for both.
		e := base.with(t)
		ten, usr := "local-"+e2e.RandomHex(4), "u1"
		for _, req := range []string{"r1", "r2"} {
			e.publish(events.NewReserved("test/admission", events.Reserved{
				RequestID: req, Tenant: ten, User: usr, Endpoint: "/x", EstimatedTokens: 100,
				ExpiresAt: time.Now().Add(time.Hour),
			}, time.Now()))
			e.waitStatus(ten, usr, req, "open")
		}
		e.publish(e.actual(ten, usr, "r1", "", 30, 10)) // 40
		e.publish(events.NewReleased("test/service", events.Released{RequestID: "r2", Tenant: ten, User: usr}, time.Now()))
		e.waitStatus(ten, usr, "r1", "settled")
		e.waitStatus(ten, usr, "r2", "released")
		if got := e.used(ten, usr, "5h"); got != 40 {
			t.Errorf("5h used = %d, want 40 (the actual in full, nothing released)", got)
		}
	})

	t.Run("released", func(t *testing.T) {
		e := base.with(t)
		ten, usr, req := "rel-"+e2e.RandomHex(4), "u1", "r1"
		e.reserve(ten, usr, req, 100, true)
		e.publish(events.NewReleased("test/service", events.Released{RequestID: req, Tenant: ten, User: usr}, time.Now()))
		e.waitStatus(ten, usr, req, "released")
		if got := e.used(ten, usr, "5h"); got != 0 {
			t.Errorf("5h used = %d, want 0", got)
		}
	})

	// A delivery that applied its event in Redis and died before the ledger
	// commit leaves Redis ahead of the ledger. If the request id's other
	// event comes before the redelivery, the actual still wins, whichever
	// was applied first: Redis and the ledger end with the actual charged.
	inRedisFirst := func(t *testing.T, release bool) (e *env, ten, usr, req string) {
		e = base.with(t)
		ten, usr, req = "crash-"+e2e.RandomHex(4), "u1", "r1"
		e.reserve(ten, usr, req, 100, true)
		e.waitStatus(ten, usr, req, "open")
		st := limits.Settle{Tenant: ten, User: usr, RequestID: req, Actual: 40, Rules: e.rules(ten)}
		var err error
		if release {
			_, err = e.lim.Release(context.Background(), st)
		} else {
			_, err = e.lim.Correct(context.Background(), st)
		}
		if err != nil {
			t.Fatal(err)
		}
		return e, ten, usr, req
	}
	consumed := func(e *env, typ, ten string) {
		e2e.Eventually(e.t, typ+" consumed", func() bool {
			return e.count("SELECT count(*) FROM usage_events WHERE type=$1 AND tenant=$2", typ, ten) == 1
		})
	}
	t.Run("actual applied in Redis before a crash, then a release", func(t *testing.T) {
		e, ten, usr, req := inRedisFirst(t, false)
		e.publish(events.NewReleased("test/service", events.Released{RequestID: req, Tenant: ten, User: usr}, time.Now()))
		consumed(e, events.TypeReleased, ten)
		e.publish(e.actual(ten, usr, req, "", 30, 10)) // the redelivery
		e.waitStatus(ten, usr, req, "settled")
		if got := e.used(ten, usr, "5h"); got != 40 {
			t.Errorf("5h used = %d, want 40 (the actual, applied first)", got)
		}
	})
	t.Run("release applied in Redis before a crash, then the actual", func(t *testing.T) {
		e, ten, usr, req := inRedisFirst(t, true)
		e.publish(e.actual(ten, usr, req, "", 30, 10))
		e.waitStatus(ten, usr, req, "settled")
		e.publish(events.NewReleased("test/service", events.Released{RequestID: req, Tenant: ten, User: usr}, time.Now())) // the redelivery
		consumed(e, events.TypeReleased, ten)
		if st := e.status(ten, usr, req); st != "settled" {
			t.Errorf("status after the release's redelivery = %s, want settled (the actual wins)", st)
		}
		if got := e.used(ten, usr, "5h"); got != 40 {
			t.Errorf("5h used = %d, want 40 (the actual in full after the release)", got)
		}
	})

	t.Run("actual after a release whose record Redis lost", func(t *testing.T) {
		// The ledger's copy stands in for the record: the estimate was
		// given back, so the actual is charged in full, not as actual -
		// estimate.
		e := base.with(t)
		ten, usr, req := "relgone-"+e2e.RandomHex(4), "u1", "r1"
		e.reserve(ten, usr, req, 100, true)
		e.waitStatus(ten, usr, req, "open")
		e.publish(events.NewReleased("test/service", events.Released{RequestID: req, Tenant: ten, User: usr}, time.Now()))
		e.waitStatus(ten, usr, req, "released")
		if err := e.redis.Client().Del(context.Background(), reservationKey(ten, usr, req)).Err(); err != nil {
			t.Fatal(err)
		}
		e.publish(e.actual(ten, usr, req, "", 30, 10))
		e.waitStatus(ten, usr, req, "settled")
		if got := e.used(ten, usr, "5h"); got != 40 {
			t.Errorf("5h used = %d, want 40 (the actual in full)", got)
		}
	})

	t.Run("released events from admission", func(t *testing.T) {
		// What admission's release did decides what the accounter does:
		// released: Redis gave the estimate back (the accounter's release
		// changes nothing more); already_settled: nothing; unknown: nothing
		// where Redis holds a reservation of the id (it came after).
		e := base.with(t)
		ten, usr := "relst-"+e2e.RandomHex(4), "u1"
		e.reserve(ten, usr, "rel", 100, true)
		e.reserve(ten, usr, "late", 100, true)
		e.waitStatus(ten, usr, "late", "open")
		if _, err := e.lim.Release(context.Background(), limits.Settle{Tenant: ten, User: usr, RequestID: "rel", Rules: e.rules(ten)}); err != nil {
			t.Fatal(err)
		}
		for _, d := range []events.Released{
			{RequestID: "rel", Tenant: ten, User: usr, Status: events.ReleaseReleased, ReturnedTokens: 100},
			{RequestID: "late", Tenant: ten, User: usr, Status: events.ReleaseUnknown},
		} {
			e.publish(events.NewReleased("quotaflow/admission", d, time.Now()))
		}
		e.waitStatus(ten, usr, "rel", "released")
		e2e.Eventually(t, "both released events consumed", func() bool {
			return e.count("SELECT count(*) FROM usage_events WHERE type=$1 AND tenant=$2", events.TypeReleased, ten) == 2
		})
		if st := e.status(ten, usr, "late"); st != "open" {
			t.Errorf("status of the id reserved after a release that found nothing = %s, want open", st)
		}
		if got := e.used(ten, usr, "5h"); got != 100 {
			t.Errorf("5h used = %d, want 100 (the later reservation only)", got)
		}
	})

	t.Run("local reservation expired at the estimate", func(t *testing.T) {
		// No Redis window held it: settling it at the estimate charges it.
		e := base.with(t)
		ten, usr, req := "lexp-"+e2e.RandomHex(4), "u1", "r1"
		e.publish(events.NewReserved("test/admission", events.Reserved{
			RequestID: req, Tenant: ten, User: usr, Endpoint: "/x", EstimatedTokens: 100,
			ExpiresAt: time.Now().Add(time.Hour),
		}, time.Now()))
		e.waitStatus(ten, usr, req, "open")
		if got := e.used(ten, usr, "5h"); got != 0 {
			t.Fatalf("5h used while open = %d, want 0 (decided without Redis)", got)
		}
		e.waitStatus(ten, usr, req, "expired") // after QF_RESERVATION_TTL (3s)
		if got := e.used(ten, usr, "5h"); got != 100 {
			t.Errorf("5h used = %d, want 100 (the estimate, charged at expiry)", got)
		}
	})

	t.Run("expired reservation settled at the estimate", func(t *testing.T) {
		e := base.with(t)
		ten, usr, req := "exp-"+e2e.RandomHex(4), "u1", "r1"
		e.reserve(ten, usr, req, 100, true)
		e.waitStatus(ten, usr, req, "open")
		e.waitStatus(ten, usr, req, "expired") // after QF_RESERVATION_TTL (3s)
		if got := e.used(ten, usr, "5h"); got != 100 {
			t.Errorf("5h used = %d, want 100", got)
		}
		// A late actual is recorded but corrects nothing.
		late := e.actual(ten, usr, req, "", 10, 0)
		e.publish(late)
		e2e.Eventually(t, "late actual recorded", func() bool {
			return e.count("SELECT count(*) FROM reservations WHERE convert_from(actual_event, 'UTF8')::jsonb->>'id' = $1", late.ID) == 1
		})
		time.Sleep(200 * time.Millisecond)
		if got, st := e.used(ten, usr, "5h"), e.status(ten, usr, req); got != 100 || st != "expired" {
			t.Errorf("after a late actual: used %d, status %s; want 100, expired", got, st)
		}
	})

	t.Run("metrics", func(t *testing.T) {
		resp, err := http.Get("http://" + base.ops + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		for _, want := range []string{
			`quotaflow_accounter_events_total{result="ok",type="quotaflow.usage.actual"}`,
			"quotaflow_accounter_lag_seconds",
			"quotaflow_accounter_batch_size_bucket",
			"quotaflow_accounter_batch_phase_seconds_bucket",
			"quotaflow_accounter_rebuilds_total",
		} {
			if !strings.Contains(string(body), want) {
				t.Errorf("/metrics lacks %s", want)
			}
		}
		e := base.with(t)
		// The subtests above each published a correction.
		if n := e.metric(`quotaflow_events_published_total{type="quotaflow.usage.corrected"}`); n < 4 {
			t.Errorf("corrected events published = %v, want at least 4", n)
		}
		// A fresh Redis answers NOSCRIPT at first: not an error.
		for _, op := range []string{"consume", "epoch", "expiry", "reconcile", "other"} {
			if n := e.metric(`quotaflow_redis_errors_total{op="` + op + `"}`); n != 0 {
				t.Errorf("redis errors of %s with Redis up = %v, want 0", op, n)
			}
		}
	})

	t.Run("poison message goes to the DLQ", func(t *testing.T) {
		e := base.with(t)
		ten, usr, req := "poison-"+e2e.RandomHex(4), "u1", "r1"
		const dlq = `quotaflow_events_published_total{type="dlq"}`
		before := e.metric(dlq)
		if _, err := e.js.Publish(ctx, events.Subject(prefix, events.TypeActual), []byte(`{"specversion":"1.0","id":`)); err != nil {
			t.Fatal(err)
		}
		e.publish(e.actual(ten, usr, req, "", 5, 5))
		e.waitStatus(ten, usr, req, "settled")
		e2e.Eventually(t, "dead letter", func() bool {
			return e.subjectMsgs(e.cfg.DLQStream, events.DLQSubject(prefix, stream.ReasonInvalid)) == 1
		})
		e2e.Eventually(t, "dead letter counted as published", func() bool { return e.metric(dlq) == before+1 })
	})

	t.Run("a snapshot alone wrong is the alerter's to refuse", func(t *testing.T) {
		e := base.with(t)
		// The accounter reads no limit snapshot, so it records the
		// reservation of a reserved event whose snapshot alone breaks the
		// rules, and settles it; dead-lettering that event is the alerter's.
		ten, usr, req := "snap-"+e2e.RandomHex(4), "u1", "r1"
		const dlq = `quotaflow_events_published_total{type="dlq"}`
		before := e.metric(dlq)
		e.reserve(ten, usr, req, 100, false)
		raw, err := events.Encode(events.NewReserved("test/admission", events.Reserved{
			RequestID: req, Tenant: ten, User: usr, Endpoint: "/api/v1/generate", EstimatedTokens: 100,
			ExpiresAt: time.Now().Add(time.Hour), Version: 1,
			Limits: []events.LimitState{{Scope: "user", Name: "5h", Unit: "tokens", Limit: 1000, Used: 100, Remaining: 900}},
		}, time.Now()))
		if err != nil {
			t.Fatal(err)
		}
		raw = bytes.Replace(raw, []byte(`"scope":"user"`), []byte(`"scope":"planet"`), 1)
		if _, err := events.Decode(raw); err == nil {
			t.Fatal("the snapshot is valid")
		}
		if _, err := e.js.Publish(ctx, events.Subject(prefix, events.TypeReserved), raw); err != nil {
			t.Fatal(err)
		}
		e.publish(e.actual(ten, usr, req, "", 30, 0))
		// Two workers may handle the actual before the reserved published
		// ahead of it (design §6: any order ends equal): wait for both.
		e2e.Eventually(t, "the reservation with the estimate and the actual", func() bool {
			return e.count(`SELECT count(*) FROM reservations WHERE tenant = $1 AND estimated_tokens = 100 AND actual_tokens = 30 AND status = 'settled'`, ten) == 1
		})
		if got := e.metric(dlq); got != before {
			t.Errorf("dead letters %v, want %v", got, before)
		}
	})

	t.Run("an event Postgres refuses goes to the DLQ", func(t *testing.T) {
		e := base.with(t)
		// Postgres refuses no event the accounter checked: a trigger of
		// this test's database refuses one tenant's as a data exception
		// (SQLSTATE 22023, as for a value Postgres cannot hold). It is
		// published between good ones, which must not be held up.
		ten := "bad-" + e2e.RandomHex(4)
		for _, q := range []string{
			`CREATE FUNCTION refuse_` + ten[4:] + `() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
				IF NEW.tenant = '` + ten + `-x' THEN RAISE EXCEPTION 'refused' USING ERRCODE = '22023'; END IF;
				RETURN NEW; END $$`,
			`CREATE TRIGGER refuse_` + ten[4:] + ` BEFORE INSERT ON reservations FOR EACH ROW EXECUTE FUNCTION refuse_` + ten[4:] + `()`,
		} {
			if _, err := e.pg.Exec(ctx, q); err != nil {
				t.Fatal(err)
			}
		}
		t.Cleanup(func() {
			_, _ = e.pg.Exec(context.Background(), `DROP TRIGGER refuse_`+ten[4:]+` ON reservations`)
		})
		e.publish(e.actual(ten, "u1", "before", "", 1, 1))
		e.publish(e.actual(ten+"-x", "u1", "r1", "", 1, 1))
		e.publish(e.actual(ten, "u1", "after", "", 1, 1))
		e.waitStatus(ten, "u1", "before", "settled")
		e.waitStatus(ten, "u1", "after", "settled")
		e2e.Eventually(t, "dead letter", func() bool {
			return e.subjectMsgs(e.cfg.DLQStream, events.DLQSubject(prefix, "ledger_rejected")) == 1
		})
		if n := e.count(`SELECT count(*) FROM reservations WHERE tenant = $1`, ten+"-x"); n != 0 {
			t.Errorf("%d reservations of the refused event, want 0", n)
		}
	})

	t.Run("an event the audit read cannot parse goes to the DLQ", func(t *testing.T) {
		e := base.with(t)
		// Two valid events in one batch between good ones: one whose
		// extension attribute holds \u0000, one whose tenant holds an
		// unpaired surrogate escape (it reads as U+FFFD). jsonb refuses
		// both, so the audit read of their rows would fail: each is
		// dead-lettered once, the others recorded.
		ten := "raw-" + e2e.RandomHex(4)
		dlq := events.DLQSubject(prefix, "ledger_rejected")
		before := e.subjectMsgs(e.cfg.DLQStream, dlq)
		var elems [][]byte
		for i, req := range []string{"before", "nul", "surrogate", "after"} {
			tenant := ten
			if i == 2 {
				tenant = ten + "-x"
			}
			raw, err := events.Encode(e.actual(tenant, "u1", req, "", 1, 1))
			if err != nil {
				t.Fatal(err)
			}
			switch i {
			case 1:
				raw = append([]byte(`{"qfext":"a\u0000b",`), raw[1:]...)
			case 2:
				raw = bytes.ReplaceAll(raw, []byte(ten+"-x"), []byte(ten+`\ud800`))
			}
			if _, err := events.Decode(raw); err != nil {
				t.Fatalf("event %d is invalid: %v", i, err)
			}
			elems = append(elems, raw)
		}
		m := nats.NewMsg(events.Subject(prefix, events.TypeActual))
		m.Data = append(append([]byte("["), bytes.Join(elems, []byte(","))...), ']')
		m.Header.Set("Content-Type", events.BatchContentType)
		if _, err := e.js.PublishMsg(ctx, m); err != nil {
			t.Fatal(err)
		}
		e.consumedAll(ten, 2)
		e2e.Eventually(t, "dead letters", func() bool { return e.subjectMsgs(e.cfg.DLQStream, dlq) >= before+2 })
		if n := e.subjectMsgs(e.cfg.DLQStream, dlq); n != before+2 {
			t.Errorf("%d dead letters, want 2", n-before)
		}
		if n := e.count(`SELECT count(*) FROM reservations WHERE tenant = $1 OR tenant = $2`, ten, ten+"\ufffd"); n != 2 {
			t.Errorf("%d reservations, want 2 (before, after)", n)
		}
		// The documented audit read works over every row stored.
		if n := e.count(`SELECT count(*) FROM reservations WHERE convert_from(actual_event, 'UTF8')::jsonb IS NOT NULL`); n < 2 {
			t.Errorf("the audit read found %d events, want at least 2", n)
		}
	})
}

// initialised writes the epoch, as in a Redis the accounter initialised
// before: admission's view.
func (e *env) initialised(t *testing.T) {
	t.Helper()
	if err := repair.WriteEpoch(context.Background(), e.redis.Client(), "test"); err != nil {
		t.Fatal(err)
	}
}

// oneBatch makes one worker take everything published in one batch.
func (e *env) oneBatch() {
	e.cfg.Workers = 1
	e.cfg.BatchSize = 1000
	e.cfg.BatchWait = 500 * time.Millisecond
}

func TestRedeliveredBatchCountsOnce(t *testing.T) {
	e := newEnv(t)
	e.initialised(t)
	e.oneBatch()
	ten := "redeliver-" + e2e.RandomHex(4)
	const n = 20
	var want int64
	for i := range n {
		req := fmt.Sprintf("r%d", i)
		e.reserve(ten, "u1", req, 100, true)
		e.publish(e.actual(ten, "u1", req, "", int64(10+i), 0))
		want += int64(10 + i)
	}

	// The first accounter applies a whole batch, then "crashes" before
	// any ack.
	abandoned := make(chan int, 1)
	var first atomic.Bool
	stop := e.start(&hooks{beforeAck: func(size int) error {
		if first.CompareAndSwap(false, true) {
			abandoned <- size
		}
		return errors.New("crash")
	}})
	var size int
	select {
	case size = <-abandoned:
	case <-time.After(20 * time.Second):
		t.Fatal("no batch handled")
	}
	stop()
	if size < 2 {
		t.Logf("the abandoned batch held %d messages", size)
	}
	if got := e.count("SELECT count(*) FROM reservations WHERE tenant=$1", ten); got == 0 {
		t.Fatal("the abandoned batch wrote nothing to the ledger")
	}

	// A second accounter gets the batch again after AckWait.
	e.start(nil)
	e2e.Eventually(t, "every actual settled", func() bool {
		return e.count("SELECT count(*) FROM reservations WHERE tenant=$1 AND status='settled'", ten) == n
	})
	e.countedOnce(ten, n, want)
}

// countedOnce checks that the n actual events of tenant's user u1, of
// tokens in all, each counted once: one ledger row each (a reserved or
// actual event is its reservation row), the 5h window and the rollups hold
// tokens.
func (e *env) countedOnce(tenant string, n, tokens int64) {
	e.t.Helper()
	if got := e.count("SELECT count(*) FROM usage_events WHERE tenant=$1", tenant); got != 0 {
		e.t.Errorf("usage_events rows = %d, want 0 (an actual is its reservation row)", got)
	}
	if got := e.count("SELECT count(actual_event) FROM reservations WHERE tenant=$1", tenant); got != n {
		e.t.Errorf("reservations recording an actual = %d, want %d", got, n)
	}
	if got := e.used(tenant, "u1", "5h"); got != tokens {
		e.t.Errorf("5h used = %d, want %d (each actual once)", got, tokens)
	}
	if got := e.count("SELECT coalesce(sum(tokens), 0) FROM usage_rollups WHERE tenant=$1", tenant); got != tokens {
		e.t.Errorf("rollup tokens = %d, want %d", got, tokens)
	}
}

// consumedAll waits until the n reservations of tenant are settled and
// the consumer has nothing pending or unacknowledged.
func (e *env) consumedAll(tenant string, n int64) {
	e.t.Helper()
	e2e.Eventually(e.t, "every actual settled", func() bool {
		return e.count("SELECT count(*) FROM reservations WHERE tenant=$1 AND status='settled'", tenant) == n
	})
	e2e.Eventually(e.t, "the stream consumed", func() bool {
		info, err := e.js.Consumer(context.Background(), e.cfg.Stream, e.cfg.Durable)
		return err == nil && info.CachedInfo().NumPending == 0 && info.CachedInfo().NumAckPending == 0
	})
}

// TestConflictingCopiesKeepTheFirst publishes actual events twice under
// the same ids with other figures, in batches formed differently (both
// stored: their batch ids differ), so both copies reach one consumer
// batch: the first copy stored counts, in the ledger and in Redis alike,
// as JetStream's dedup kept the first of single events.
func TestConflictingCopiesKeepTheFirst(t *testing.T) {
	e := newEnv(t)
	e.initialised(t)
	e.oneBatch()
	ctx := context.Background()
	ten := "conflict-" + e2e.RandomHex(4)
	const n = 20
	var first, second []events.Event
	for i := range n {
		req := fmt.Sprintf("r%d", i)
		e.reserve(ten, "u1", req, 100, true)
		first = append(first, e.actual(ten, "u1", req, "", int64(10+i), 0))
		second = append(second, e.actual(ten, "u1", req, "", 999, 0))
		if first[i].ID != second[i].ID {
			t.Fatal("the copies need one id")
		}
	}
	// r0..r11 first as first[i]; r12..r19 first as 999 (second[5:] is
	// stored after first[:12]).
	for _, part := range [][]events.Event{first[:12], second[5:]} {
		if err := e.pub.PublishBatch(ctx, part); err != nil {
			t.Fatal(err)
		}
	}
	var want int64
	for i := range n {
		if i < 12 {
			want += int64(10 + i)
		} else {
			want += 999
		}
	}
	e.start(nil)
	e.consumedAll(ten, n)
	if got := e.count("SELECT coalesce(sum(actual_tokens), 0) FROM reservations WHERE tenant=$1", ten); got != want {
		t.Errorf("reservations' actual tokens = %d, want %d (the first copy of each)", got, want)
	}
	e.countedOnce(ten, n, want)
}

// TestSameIDOfAnotherTenantIsNoCopy: event ids are unique per tenant (the
// ledger keys events by tenant and id), so a batch holding two tenants'
// events of one id records and charges both, not the first alone.
func TestSameIDOfAnotherTenantIsNoCopy(t *testing.T) {
	e := newEnv(t)
	e.start(nil)
	ctx := context.Background()
	a, b := "ida-"+e2e.RandomHex(4), "idb-"+e2e.RandomHex(4)
	evA := e.actual(a, "u", "r1", "", 100, 0)
	evB := e.actual(b, "u", "r1", "", 900, 0)
	evB.ID = evA.ID
	// By hand: a Publisher, as JetStream does with single events, sends
	// an id once.
	body, err := events.EncodeBatch([]events.Event{evA, evB})
	if err != nil {
		t.Fatal(err)
	}
	m := nats.NewMsg(events.Subject(e.cfg.SubjectPrefix, events.TypeActual))
	m.Data = body
	m.Header.Set("Content-Type", events.BatchContentType)
	if _, err := e.js.PublishMsg(ctx, m); err != nil {
		t.Fatal(err)
	}
	e.waitStatus(a, "u", "r1", "settled")
	e.waitStatus(b, "u", "r1", "settled")
	if ua, ub := e.used(a, "u", "5h"), e.used(b, "u", "5h"); ua != 100 || ub != 900 {
		t.Errorf("5h used = %d and %d, want 100 and 900 (each tenant's actual in full)", ua, ub)
	}
}

// TestLaterActualSettlesWithTheFirst: a request's first actual is
// recorded but its Redis correction fails (Redis lost its epoch: the event
// goes back, the row stays open with that actual); another actual of the
// request, under another id, comes before it again. Redis must be
// corrected by the actual the ledger kept, the first, not by the event at
// hand: the windows and the ledger then hold the same cost.
func TestLaterActualSettlesWithTheFirst(t *testing.T) {
	e := newEnv(t)
	e.initialised(t)
	// Neither the epoch check nor reconciliation repairs Redis meanwhile.
	e.cfg.EpochInterval, e.cfg.ReconcileRepair = time.Hour, false
	ctx := context.Background()
	ten, usr, req := "second-"+e2e.RandomHex(4), "u1", "r1"
	stop := e.start(nil)
	e.reserve(ten, usr, req, 100, true)
	e.waitStatus(ten, usr, req, "open")

	rdb := e.redis.Client()
	for it := rdb.Scan(ctx, 0, "qe{*", 1000).Iterator(); it.Next(ctx); {
		if err := rdb.Del(ctx, it.Val()).Err(); err != nil {
			t.Fatal(err)
		}
	}
	e.publish(e.actual(ten, usr, req, "", 40, 0))
	e2e.Eventually(t, "the first actual recorded, its correction not", func() bool {
		return e.count("SELECT count(*) FROM reservations WHERE tenant=$1 AND actual_tokens=40 AND status='open'", ten) == 1
	})
	stop()
	// The second actual comes first: the first's redelivery would find the
	// row settled and change nothing.
	s, err := e.js.Stream(ctx, e.cfg.Stream)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Purge(ctx, jetstream.WithPurgeSubject(events.Subject(e.cfg.SubjectPrefix, events.TypeActual))); err != nil {
		t.Fatal(err)
	}
	e.initialised(t)
	second := e.actual(ten, usr, req, "", 90, 0)
	second.ID = e2e.RandomHex(16) // not the first's: past the dedup window, or another sender's
	e.publish(second)
	e.start(nil)
	e.waitStatus(ten, usr, req, "settled")
	if got := e.count("SELECT actual_tokens FROM reservations WHERE tenant=$1", ten); got != 40 {
		t.Errorf("ledger actual = %d, want 40 (the first)", got)
	}
	if got := e.used(ten, usr, "5h"); got != 40 {
		t.Errorf("5h used = %d, want 40 (the ledger's actual)", got)
	}
}

// TestReformedBatchesCountOnce publishes the same events in two batches
// formed differently (JetStream stores both: their batch ids differ) and
// once more alone: the ledger, the Redis windows and the corrections count
// each event id once.
func TestReformedBatchesCountOnce(t *testing.T) {
	e := newEnv(t)
	e.initialised(t)
	ctx := context.Background()
	ten := "reformed-" + e2e.RandomHex(4)
	const n = 20
	var reserved, actuals []events.Event
	var want int64
	for i := range n {
		req := fmt.Sprintf("r%d", i)
		d, err := e.lim.Reserve(ctx, limits.Request{Tenant: ten, User: "u1", RequestID: req, Cost: 100, Rules: e.rules(ten)})
		if err != nil || !d.Allowed {
			t.Fatalf("Reserve = %+v, %v", d, err)
		}
		reserved = append(reserved, events.NewReserved("test/admission", events.Reserved{
			RequestID: req, Tenant: ten, User: "u1", Endpoint: "/api/v1/generate",
			EstimatedTokens: 100, ExpiresAt: time.Now().Add(time.Hour), Version: d.Version,
		}, time.Now()))
		actuals = append(actuals, e.actual(ten, "u1", req, "", int64(10+i), 0))
		want += int64(10 + i)
	}
	for _, part := range [][]events.Event{reserved, reserved[:7], actuals[:12], actuals[5:], reserved[3:9]} {
		if err := e.pub.PublishBatch(ctx, part); err != nil {
			t.Fatal(err)
		}
	}
	e.publish(actuals[8])
	ids := natstest.StreamEvents(t, e.js, e.cfg.Stream)
	if ids[actuals[8].ID] != 3 || ids[reserved[4].ID] != 3 {
		t.Fatalf("the stream holds actual 8 %d times and reserved 4 %d times, want 3 each (the test needs the copies)",
			ids[actuals[8].ID], ids[reserved[4].ID])
	}

	e.start(nil)
	e.consumedAll(ten, n)
	if got := e.count("SELECT count(*) FROM reservations WHERE tenant=$1", ten); got != n {
		t.Errorf("reservations rows = %d, want %d", got, n)
	}
	e.countedOnce(ten, n, want)
	corrected := map[string]bool{}
	for _, ev := range natstest.StoredEvents(t, e.js, e.cfg.Stream) {
		if c, ok := ev.Data.(events.Corrected); ok && c.Tenant == ten {
			corrected[ev.ID] = true
		}
	}
	if len(corrected) != n {
		t.Errorf("%d corrected event ids, want %d (one per request)", len(corrected), n)
	}
	if ids := natstest.StreamEvents(t, e.js, e.cfg.DLQStream); len(ids) != 0 {
		t.Errorf("dead letters: %v, want none", ids)
	}
}

// TestLargeFetchIsNotRedelivered handles one fetch of three messages of
// ten events each in three ledger batches that together take longer than
// AckWait: the later batches' messages must not be redelivered while they
// wait behind the earlier ones (stream.Pending marks them in progress), so
// every event is handled exactly once.
func TestLargeFetchIsNotRedelivered(t *testing.T) {
	e := newEnv(t)
	e.initialised(t)
	// One worker takes the whole fetch; the other's pulls would get any
	// message the server redelivers meanwhile.
	e.cfg.Workers = 2
	e.cfg.BatchSize = 10 // messages per fetch, and events per batch: one message a batch
	e.cfg.BatchWait = 500 * time.Millisecond
	// Room for a batch's own work on a busy machine beside the hook's wait.
	e.cfg.AckWait = 5 * time.Second
	ten := "bigfetch-" + e2e.RandomHex(4)
	const msgs, per = 3, 10
	var want int64
	for m := range msgs {
		var evs []events.Event
		for i := range per {
			req := fmt.Sprintf("r%d-%d", m, i)
			e.reserve(ten, "u1", req, 100, false)
			evs = append(evs, e.actual(ten, "u1", req, "", int64(10+i), 0))
			want += int64(10 + i)
		}
		if err := e.pub.PublishBatch(context.Background(), evs); err != nil {
			t.Fatal(err)
		}
	}
	if got := natstest.StreamMsgs(t, e.js, e.cfg.Stream); got != msgs {
		t.Fatalf("the stream holds %d messages, want %d (the test needs one batch message per PublishBatch)", got, msgs)
	}

	// Each batch waits 60 % of AckWait before its acks: the last one
	// starts more than AckWait after its delivery, so only a mark made
	// while it waits behind the others keeps it from being redelivered.
	var handled atomic.Int64
	e.start(&hooks{beforeAck: func(n int) error {
		handled.Add(int64(n))
		time.Sleep(e.cfg.AckWait * 60 / 100)
		return nil
	}})
	e.consumedAll(ten, msgs*per)
	if got := handled.Load(); got != msgs*per {
		t.Errorf("%d events handled, want %d: messages were redelivered while they waited in their fetch", got, msgs*per)
	}
	e.countedOnce(ten, msgs*per, want)
}

// TestRequestsEventsShareABatch publishes, before the accounter starts,
// messages of two requests' reserved events, then of their actuals, and
// so on, six messages a fetch (BatchSize): runs of at most six events cut
// after three messages would part every other pair of requests, so the
// fetch's runs end where none is parted (stream.RunsBy). Each request's
// row is then written once, by the transaction that inserted its key.
func TestRequestsEventsShareABatch(t *testing.T) {
	e := newEnv(t)
	e.initialised(t)
	e.cfg.BatchSize = 6
	ten := "together-" + e2e.RandomHex(4)
	const n = 12
	for i := 0; i < n; i += 2 {
		var reserved, actuals []events.Event
		for _, req := range []string{fmt.Sprint("r", i), fmt.Sprint("r", i+1)} {
			reserved = append(reserved, e.reserve(ten, "u1", req, 100, false))
			actuals = append(actuals, e.actual(ten, "u1", req, "", 10, 0))
		}
		for _, evs := range [][]events.Event{reserved, actuals} {
			if err := e.pub.PublishBatch(context.Background(), evs); err != nil {
				t.Fatal(err)
			}
		}
	}
	e.start(nil)
	e.consumedAll(ten, n)
	e.countedOnce(ten, n, 10*n)
	// A row updated by a later batch has that batch's xmin, not its key's.
	if got := e.count(`SELECT count(*) FROM reservations r JOIN reservation_keys k USING (tenant, user_id, request_id)
		WHERE r.tenant = $1 AND NOT r.xmin = k.xmin`, ten); got != 0 {
		t.Errorf("%d of %d requests' rows written again by a later batch, want 0", got, n)
	}
}

func TestRedisLossRebuildsWindows(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.start(nil) // a brand-new Redis and an empty ledger: the epoch is written at once
	e.waitEpoch(t, "epoch written at start")

	ten := "flush-" + e2e.RandomHex(4)
	users := []string{"a", "b", "c"}
	for i, u := range users {
		e.reserve(ten, u, "settled", 200, true)
		e.publish(e.actual(ten, u, "settled", "", int64(50*(i+1)), 0))
		e.reserve(ten, u, "open", 300, true) // no actual yet
		e.reserve(ten, u, "released", 400, true)
		e.publish(events.NewReleased("test/service", events.Released{RequestID: "released", Tenant: ten, User: u}, time.Now()))
	}
	e.publish(e.actual(ten, "d", "unreserved", "", 77, 0))
	for _, u := range users {
		e.waitStatus(ten, u, "settled", "settled")
		e.waitStatus(ten, u, "released", "released")
		e.waitStatus(ten, u, "open", "open")
	}
	e.waitStatus(ten, "d", "unreserved", "settled")
	before := map[string][2]int64{}
	for _, u := range append(users, "d") {
		before[u] = [2]int64{e.used(ten, u, "5h"), e.used(ten, u, "30d")}
	}

	// A reservation the lost Redis held whose reserved event reaches the
	// ledger only after the rebuild: the rebuilt Redis never counted it.
	inflight, err := e.lim.Reserve(ctx, limits.Request{Tenant: ten, User: "c", RequestID: "inflight", Cost: 250, Rules: e.rules(ten)})
	if err != nil || !inflight.Allowed {
		t.Fatalf("Reserve = %+v, %v", inflight, err)
	}
	reservedAt := time.Now()

	e.redis.Stop()
	e.redis.Restart() // empty: no persistence
	e.waitEpoch(t, "epoch rewritten")
	for u, want := range before {
		if got := [2]int64{e.used(ten, u, "5h"), e.used(ten, u, "30d")}; got != want {
			t.Errorf("%s: used (5h, 30d) after the rebuild = %v, want %v", u, got, want)
		}
	}

	// The open reservation's actual still corrects it, from the ledger's copy.
	e.publish(e.actual(ten, "a", "open", "", 120, 0))
	e.waitStatus(ten, "a", "open", "settled")
	if got, want := e.used(ten, "a", "5h"), before["a"][0]-300+120; got != want {
		t.Errorf("a: 5h used after the late actual = %d, want %d", got, want)
	}

	e.publish(events.NewReserved("test/admission", events.Reserved{
		RequestID: "inflight", Tenant: ten, User: "c", Endpoint: "/api/v1/generate",
		EstimatedTokens: 250, ExpiresAt: reservedAt.Add(time.Hour), Version: inflight.Version,
	}, reservedAt))
	e.publish(e.actual(ten, "c", "inflight", "", 100, 0))
	e.waitStatus(ten, "c", "inflight", "settled")
	if got, want := e.used(ten, "c", "5h"), before["c"][0]+100; got != want {
		t.Errorf("c: 5h used after the in-flight reservation's actual = %d, want %d (charged in full)", got, want)
	}
	before["c"] = [2]int64{before["c"][0] + 100, before["c"][1] + 100}

	// Reconciliation agrees with the rebuilt Redis, and takes back tokens
	// the ledger never heard of.
	e2e.Eventually(t, "no drift", func() bool { return e.metric("quotaflow_accounter_drift_tokens") == 0 })
	if _, err := repair.New(e.redis.Client(), limits.Options{}).Charge(ctx, repair.ChargeRequest{Tenant: ten, User: "b", Rules: e.rules(ten)[:2], Amount: 500}); err != nil {
		t.Fatal(err)
	}
	e2e.Eventually(t, "1000 tokens (500 in each of two windows) repaired", func() bool {
		return e.metric(`quotaflow_accounter_repaired_tokens_total{direction="lowered"}`) == 1000
	})
	if got := [2]int64{e.used(ten, "b", "5h"), e.used(ten, "b", "30d")}; got != before["b"] {
		t.Errorf("b: used (5h, 30d) after the repair = %v, want %v", got, before["b"])
	}
	if got := e.metric(`quotaflow_accounter_repaired_tokens_total{direction="raised"}`); got != 0 {
		t.Errorf("raised %v tokens, want 0", got)
	}
}

// TestRedisLossRebuildsBalances: prepaid credits survive Redis losing its
// data: top-ups come back as credit, what requests hold as spent, for
// every user of a tenant.
func TestRedisLossRebuildsBalances(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.start(nil)
	e.waitEpoch(t, "epoch written at start")
	const ten = "prepaid" // the policy's tenant on the plan with a balance
	rules := e.rules(ten)
	bal := &rules[1]
	balance := func(user string) (credited, spent int64) { return e.balance(t, ten, user) }
	for _, ref := range []string{"pay-1", "pay-2", "pay-3"} { // as admission does: Redis, then the event
		user := "u"
		if ref == "pay-3" {
			user = "v"
		}
		if _, err := e.lim.TopUp(ctx, ten, user, bal, 1000, ref); err != nil {
			t.Fatal(err)
		}
		e.publish(events.NewTopUp("test/admission", events.TopUp{Tenant: ten, User: user, Amount: 1000, Reference: ref}, time.Now()))
	}
	e.reserve(ten, "u", "done", 300, true)
	e.publish(e.actual(ten, "u", "done", "", 120, 0))
	e.reserve(ten, "u", "open", 200, true) // no actual yet: its estimate is spent
	e.waitStatus(ten, "u", "done", "settled")
	e.waitStatus(ten, "u", "open", "open")
	e2e.Eventually(t, "top-ups in the ledger", func() bool {
		var n int
		_ = e.pg.QueryRow(ctx, "SELECT count(*) FROM usage_events WHERE type = 'quotaflow.balance.topup'").Scan(&n)
		return n == 3
	})
	if c, sp := balance("u"); c != 2000 || sp != 320 {
		t.Fatalf("balance before = credited %d, spent %d; want 2000, 320", c, sp)
	}

	e.redis.Stop()
	e.redis.Restart()
	e.waitEpoch(t, "epoch rewritten")
	if c, sp := balance("u"); c != 2000 || sp != 320 {
		t.Errorf("balance after the rebuild = credited %d, spent %d; want 2000, 320", c, sp)
	}
	if c, sp := balance("v"); c != 1000 || sp != 0 {
		t.Errorf("the other user's balance after the rebuild = credited %d, spent %d; want 1000, 0", c, sp)
	}
}

// TestRebuildSpendsBalanceOnlyUnderItsPlans: Redis spends a prepaid
// balance only for requests under a plan that holds it, so a rebuild must
// not count the subject's usage under another plan (an unbound gateway
// token may name any plan; a plan change leaves the old plan's history).
func TestRebuildSpendsBalanceOnlyUnderItsPlans(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.start(nil)
	e.waitEpoch(t, "epoch written at start")
	const ten = "prepaid"
	rules := e.rules(ten)
	bal := &rules[1]
	balance := func() (credited, spent int64) { return e.balance(t, ten, "u") }
	free, err := e.policy.Resolve(ten, "free", "")
	if err != nil {
		t.Fatal(err)
	}
	d, err := e.lim.Reserve(ctx, limits.Request{Tenant: ten, User: "u", RequestID: "f1", Cost: 5000, Rules: free.Subject})
	if err != nil || !d.Allowed {
		t.Fatalf("Reserve on plan free = %+v, %v", d, err)
	}
	e.publish(events.NewReserved("test/admission", events.Reserved{RequestID: "f1", Tenant: ten, User: "u", Plan: "free",
		Endpoint: "/api/v1/generate", EstimatedTokens: 5000, ExpiresAt: time.Now().Add(time.Hour), Version: d.Version}, time.Now()))
	e.publish(e.actual(ten, "u", "f1", "", 5000, 0))
	if _, err := e.lim.TopUp(ctx, ten, "u", bal, 1000, "pay-1"); err != nil {
		t.Fatal(err)
	}
	e.publish(events.NewTopUp("test/admission", events.TopUp{Tenant: ten, User: "u", Amount: 1000, Reference: "pay-1"}, time.Now()))
	e.reserve(ten, "u", "p1", 300, true) // on the tenant's plan, prepaid
	e.publish(e.actual(ten, "u", "p1", "", 120, 0))
	e.waitStatus(ten, "u", "f1", "settled")
	e.waitStatus(ten, "u", "p1", "settled")
	e2e.Eventually(t, "top-up in the ledger", func() bool {
		return e.count("SELECT count(*) FROM usage_events WHERE type = 'quotaflow.balance.topup'") == 1
	})
	if c, sp := balance(); c != 1000 || sp != 120 {
		t.Fatalf("balance before = credited %d, spent %d; want 1000, 120", c, sp)
	}

	e.redis.Stop()
	e.redis.Restart()
	e.waitEpoch(t, "epoch rewritten")
	if c, sp := balance(); c != 1000 || sp != 120 {
		t.Errorf("balance after the rebuild = credited %d, spent %d; want 1000, 120 (the usage on plan free spent none)", c, sp)
	}
}

// TestTopUpInFlightAcrossARebuildIsCredited: admission credits a top-up
// in Redis, then publishes its event. When Redis loses its data before the
// accounter records the event (it waits in admission's outbox, or behind a
// backlog), the rebuild cannot count it; the accounter credits it again
// when it comes, by its reference. A copy of a top-up the rebuild counted
// (a redelivery, a replayed dead letter) credits nothing.
func TestTopUpInFlightAcrossARebuildIsCredited(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.start(nil)
	e.waitEpoch(t, "epoch written at start")
	const ten = "prepaid"
	rules := e.rules(ten)
	topUp := func(ref string) events.Event {
		t.Helper()
		if _, err := e.lim.TopUp(ctx, ten, "u", &rules[1], 1000, ref); err != nil {
			t.Fatal(err)
		}
		return events.NewTopUp("test/admission", events.TopUp{Tenant: ten, User: "u", Amount: 1000, Reference: ref}, time.Now())
	}
	topUps := func() int64 {
		return e.count("SELECT count(*) FROM usage_events WHERE type = 'quotaflow.balance.topup'")
	}
	counted := topUp("pay-1")
	e.publish(counted)
	e2e.Eventually(t, "the first top-up in the ledger", func() bool { return topUps() == 1 })
	inFlight := topUp("pay-2")

	e.redis.Stop()
	e.redis.Restart()
	e.waitEpoch(t, "epoch rewritten")
	e.publish(inFlight)
	raw, err := events.Encode(counted)
	if err != nil {
		t.Fatal(err)
	}
	m := nats.NewMsg(events.Subject(e.cfg.SubjectPrefix, events.TypeTopUp))
	m.Data = raw
	if _, err := e.js.PublishMsg(ctx, m, jetstream.WithMsgID("copy-"+counted.ID)); err != nil {
		t.Fatal(err)
	}
	e2e.Eventually(t, "the second top-up in the ledger and the copy consumed", func() bool {
		c, err := e.js.Consumer(ctx, e.cfg.Stream, e.cfg.Durable)
		if err != nil {
			return false
		}
		i, err := c.Info(ctx)
		return err == nil && i.NumPending == 0 && i.NumAckPending == 0 && topUps() == 2
	})
	if got, _ := e.balance(t, ten, "u"); got != 2000 {
		t.Errorf("credited in Redis = %d, want 2000 (the ledger's two top-ups, each once)", got)
	}
}

// metric returns the value of the series name (with its labels, as
// /metrics prints them) on /metrics.
func (e *env) metric(name string) float64 {
	e.t.Helper()
	resp, err := http.Get("http://" + e.ops + "/metrics")
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	for _, line := range strings.Split(string(body), "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			var f float64
			if _, err := fmt.Sscan(v, &f); err == nil {
				return f
			}
		}
	}
	e.t.Fatalf("no metric %s", name)
	return 0
}

func TestPostgresConnectionsKilledUnderLoad(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.start(nil)
	e.waitEpoch(t, "epoch written at start")
	db := e.pg.Config().ConnConfig.Database
	admin, err := pgx.Connect(ctx, pgtest.BaseURL())
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)

	ten := "pgkill-" + e2e.RandomHex(4)
	const n = 300
	var want int64
	published := make(chan struct{})
	go func() {
		defer close(published)
		for i := range n {
			req := fmt.Sprintf("r%d", i)
			e.reserve(ten, fmt.Sprintf("u%d", i%3), req, 100, true)
			e.publish(e.actual(ten, fmt.Sprintf("u%d", i%3), req, "", int64(i%50+1), 0))
			if i%20 == 0 {
				time.Sleep(20 * time.Millisecond)
			}
		}
	}()
	for i := 0; i < n; i++ {
		want += int64(i%50 + 1)
	}
	killed := int64(0)
	func() {
		for {
			select {
			case <-published:
				return
			case <-time.After(150 * time.Millisecond):
			}
			var k int64
			err := admin.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
				WHERE datname = $1 AND pid <> pg_backend_pid() AND application_name <> $2`, db, testAppName).Scan(&k)
			if err != nil {
				t.Fatalf("terminate: %v", err)
			}
			killed += k
		}
	}()
	t.Logf("terminated %d accounter connections", killed)
	defer func() {
		if t.Failed() {
			rows, _ := e.pg.Query(ctx, "SELECT status, count(*), count(actual_tokens), count(estimated_tokens) FROM reservations WHERE tenant=$1 GROUP BY 1", ten)
			for rows.Next() {
				var st string
				var a, b, c int64
				_ = rows.Scan(&st, &a, &b, &c)
				t.Logf("status %s: %d rows, %d actual, %d estimate", st, a, b, c)
			}
			t.Logf("dlq: %d", e.subjectMsgs(e.cfg.DLQStream, events.DLQSubject(e.cfg.SubjectPrefix, stream.ReasonMaxDeliver)))
		}
	}()
	e2e.Eventually(t, "every event in the ledger and every actual settled", func() bool {
		return e.count("SELECT count(*) FROM reservations WHERE tenant=$1 AND status='settled'", ten) == n &&
			e.count("SELECT count(actual_event) FROM reservations WHERE tenant=$1", ten) == n
	})
	var used int64
	for u := range 3 {
		used += e.used(ten, fmt.Sprintf("u%d", u), "5h")
	}
	if used != want {
		t.Errorf("5h used over the users = %d, want %d", used, want)
	}
	if got := e.count("SELECT coalesce(sum(tokens), 0) FROM usage_rollups WHERE tenant=$1", ten); got != want {
		t.Errorf("rollup tokens = %d, want %d", got, want)
	}
}

// TestRequestOnlyPlanSettles: a plan of request limits alone keeps no
// reservation record in Redis, yet its requests' actuals, releases and
// reservations that expire settle in the ledger as any other's, with
// nothing dead-lettered and every admitted request (a retried id too)
// still counted in Redis; after Redis loses its data, the rebuild finishes
// (request limits start afresh) and a late actual still settles.
func TestRequestOnlyPlanSettles(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.cfg.ReservationTTL = 3 * time.Second
	e.start(nil)
	e.waitEpoch(t, "epoch written at start")
	ten, usr := "ratesonly-"+e2e.RandomHex(4), "u"
	rules := func() []policy.Rule {
		r, err := e.policy.Resolve(ten, "rates", "")
		if err != nil {
			t.Fatal(err)
		}
		return r.Subject
	}()
	hour := func() int64 {
		d, err := e.lim.Peek(ctx, limits.Request{Tenant: ten, User: usr, Rules: rules})
		if err != nil {
			t.Fatal(err)
		}
		return d.States[0].Used
	}
	reserve := func(req string) {
		d, err := e.lim.Reserve(ctx, limits.Request{Tenant: ten, User: usr, RequestID: req, Cost: 100, Rules: rules})
		if err != nil || !d.Allowed || d.Duplicate {
			t.Fatalf("Reserve(%s) = %+v, %v; want a new request allowed", req, d, err)
		}
		e.publish(events.NewReserved("test/admission", events.Reserved{
			RequestID: req, Tenant: ten, User: usr, Plan: "rates", Endpoint: "/api/v1/generate",
			EstimatedTokens: 100, ExpiresAt: time.Now().Add(3 * time.Second), Version: d.Version,
		}, time.Now()))
	}
	for _, req := range []string{"actual", "released", "expires", "actual"} { // the last a retry
		reserve(req)
	}
	if n := e.redis.Client().Exists(ctx, reservationKey(ten, usr, "actual"), reservationKey(ten, usr, "expires")).Val(); n != 0 {
		t.Fatalf("%d reservation records in Redis, want none", n)
	}
	// The ledger holds the reservation (and its plan) before its actual
	// comes: two workers may otherwise take the actual first, and its
	// correction then knows no plan.
	e.waitStatus(ten, usr, "actual", "open")
	e.publish(e.actual(ten, usr, "actual", "", 60, 70))
	e.publish(events.NewReleased("test/service", events.Released{RequestID: "released", Tenant: ten, User: usr}, time.Now()))
	e.publish(e.actual(ten, usr, "never-reserved", "", 5, 0))
	e.waitStatus(ten, usr, "actual", "settled")
	e.waitStatus(ten, usr, "released", "released")
	e.waitStatus(ten, usr, "never-reserved", "settled")
	e.waitStatus(ten, usr, "expires", "expired")
	if got := e.count("SELECT actual_tokens FROM reservations WHERE tenant=$1 AND request_id='actual'", ten); got != 130 {
		t.Errorf("actual_tokens = %d, want 130", got)
	}
	// The correction names the plan its reservation was decided under, so
	// the alerter judges its limits by that plan's thresholds.
	plans := map[string][]string{}
	for _, ev := range natstest.StoredEvents(t, e.js, e.cfg.Stream) {
		if c, ok := ev.Data.(events.Corrected); ok && c.Tenant == ten {
			plans[c.RequestID] = append(plans[c.RequestID], c.Plan)
		}
	}
	if got := plans["actual"]; !slices.Equal(got, []string{"rates"}) {
		t.Errorf("corrected events of request actual name plans %q, want [rates]", got)
	}
	if got := hour(); got != 4 {
		t.Errorf("hour used = %d after 4 admits and their settlements, want 4", got)
	}

	e.redis.Stop()
	e.redis.Restart() // empty: no persistence
	e.waitEpoch(t, "epoch rewritten")
	if got := hour(); got != 0 {
		t.Errorf("hour used = %d after the rebuild, want 0 (request limits start afresh)", got)
	}
	reserve("late")
	e.publish(e.actual(ten, usr, "late", "", 1, 1))
	e.waitStatus(ten, usr, "late", "settled")
	if got := hour(); got != 1 {
		t.Errorf("hour used = %d after one admit since the rebuild, want 1", got)
	}
	// Read once events were consumed: the consumer registers its metrics
	// after the epoch is written, and this run's registry started at 0.
	if got := e.metric(`quotaflow_events_published_total{type="dlq"}`); got != 0 {
		t.Errorf("dead letters %v, want 0", got)
	}
}

func TestExpiredReservationReleased(t *testing.T) {
	e := newEnv(t)
	e.initialised(t)
	e.cfg.ReservationTTL = 2 * time.Second
	e.cfg.SettleExpiredAtEstimate = false
	e.start(nil)
	ten, usr, req := "exprel-"+e2e.RandomHex(4), "u1", "r1"
	e.reserve(ten, usr, req, 100, true)
	e.waitStatus(ten, usr, req, "expired_released")
	if got := e.used(ten, usr, "5h"); got != 0 {
		t.Errorf("5h used = %d, want 0 (the estimate given back)", got)
	}
}

// A reservation whose actual Redis took while the batch's commit was lost
// (a crash, Postgres failing) cannot expire: Redis holds its actual, and
// it waits for its actual's redelivery, neither settled at its estimate
// nor given back in the ledger alone (the reconciliation would then take
// the actual out of Redis). The expiry passes it by, and the reservations
// after it expire all the same.
func TestExpiryLeavesReservationRedisSettled(t *testing.T) {
	for _, tc := range []struct {
		name    string
		local   bool // decided without Redis (version 0)
		release bool // QF_SETTLE_EXPIRED_AT_ESTIMATE=false
	}{
		{"at estimate", false, false},
		{"given back", false, true},
		{"local", true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			e.cfg.ReservationTTL = 2 * time.Second
			e.cfg.SettleExpiredAtEstimate = !tc.release
			e.start(nil)
			ten, usr, req := "ahead-"+e2e.RandomHex(4), "u1", "r1"
			at := time.Now()
			if tc.local {
				e.publish(events.NewReserved("test/admission", events.Reserved{RequestID: req, Tenant: ten, User: usr,
					Endpoint: "/x", EstimatedTokens: 100, ExpiresAt: at.Add(time.Hour)}, at))
			} else {
				e.reserve(ten, usr, req, 100, true)
			}
			e.waitStatus(ten, usr, req, "open")
			// The actual's first delivery: Redis takes its correction, the
			// commit fails, and so do those of its redeliveries. Its record
			// outlives the reservation's expiry, as in production, where it
			// lives a TTL from the correction (here the test's limiter's
			// hour, not the accounter's 2 s TTL).
			keep := e.loseCommits()
			var fb *limits.Fallback
			if tc.local {
				fb = &limits.Fallback{ReservedAt: at, Estimate: limits.NoEstimate}
			}
			if _, err := e.lim.Correct(context.Background(), limits.Settle{Tenant: ten, User: usr, RequestID: req, Actual: 400,
				Rules: e.rules(ten), Fallback: fb}); err != nil {
				t.Fatal(err)
			}
			e.publish(e.actual(ten, usr, req, "", 400, 0))
			// Past its TTL and two expiry passes: the expiry has met it.
			time.Sleep(time.Until(at.Add(e.cfg.ReservationTTL + 2*e.cfg.ExpiryInterval)))
			e.reserve(ten, usr, "later", 50, true)
			later, want := "expired", int64(450) // the actual, and the estimate of later
			if tc.release {
				later, want = "expired_released", 400
			}
			e.waitStatus(ten, usr, "later", later)
			if st := e.status(ten, usr, req); st != "open" {
				t.Fatalf("status of the reservation Redis settled = %s, want open (left for its actual)", st)
			}
			keep()
			e.waitStatus(ten, usr, req, "settled")
			e.reconciled(3)
			if got := e.used(ten, usr, "5h"); got != want {
				t.Errorf("5h used = %d, want %d", got, want)
			}
		})
	}
}

// loseCommits makes every ledger commit that records an actual fail, as
// if the accounter died between Redis and its commit: a batch's Redis
// effects apply, its ledger write does not, and its events come back
// until keep is called.
func (e *env) loseCommits() (keep func()) {
	e.t.Helper()
	exec := func(q string) {
		e.t.Helper()
		if _, err := e.pg.Exec(context.Background(), q); err != nil {
			e.t.Fatalf("%s: %v", q, err)
		}
	}
	exec(`CREATE FUNCTION qf_test_lose_commit() RETURNS trigger LANGUAGE plpgsql
    AS $$ BEGIN RAISE EXCEPTION 'commit lost (test)'; END $$`)
	exec(`CREATE CONSTRAINT TRIGGER qf_test_lose_commit AFTER INSERT OR UPDATE ON reservations
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.actual_tokens IS NOT NULL)
    EXECUTE FUNCTION qf_test_lose_commit()`)
	return func() { exec(`DROP TRIGGER qf_test_lose_commit ON reservations`) }
}

// reconciled waits for n more reconciliation passes.
func (e *env) reconciled(n float64) {
	e.t.Helper()
	const passes = `quotaflow_accounter_reconciliations_total{result="ok"}`
	from := e.metric(passes)
	e2e.Eventually(e.t, fmt.Sprintf("%v reconciliations", n), func() bool { return e.metric(passes) >= from+n })
}

func TestRedisOutageDeadLettersNothing(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	if err := repair.WriteEpoch(ctx, e.redis.Client(), "test"); err != nil {
		t.Fatal(err)
	}
	e.cfg.MaxDeliver = 2 // an outage outlasts it by far
	e.start(nil)
	ten, usr, req := "outage-"+e2e.RandomHex(4), "u1", "r1"
	e.reserve(ten, usr, req, 100, true)
	e.waitStatus(ten, usr, req, "open")

	e.redis.Stop()
	e.publish(e.actual(ten, usr, req, "", 40, 0))
	e2e.Eventually(t, "several failed deliveries", func() bool {
		c, err := e.js.Consumer(ctx, e.cfg.Stream, e.cfg.Durable)
		if err != nil {
			return false
		}
		i, err := c.Info(ctx)
		return err == nil && i.NumRedelivered > 0 && i.Delivered.Consumer >= 5
	})
	for _, op := range []string{"consume", "epoch"} {
		if n := e.metric(`quotaflow_redis_errors_total{op="` + op + `"}`); n < 1 {
			t.Errorf("redis errors of %s during the outage = %v, want some", op, n)
		}
	}
	e.redis.Restart() // empty: the accounter rebuilds it from the ledger
	e.waitStatus(ten, usr, req, "settled")
	if got := e.used(ten, usr, "5h"); got != 40 {
		t.Errorf("5h used = %d, want 40", got)
	}
	if n := e.subjectMsgs(e.cfg.DLQStream, events.DLQSubject(e.cfg.SubjectPrefix, stream.ReasonMaxDeliver)); n != 0 {
		t.Errorf("%d events dead-lettered during the outage, want 0", n)
	}
}

// A Redis that answers but refuses writes (at its maxmemory under
// noeviction, the policy the accounter wants; without the replicas
// min-replicas-to-write asks for) is out as much as one that is down: the
// actual waits for it through more deliveries than MaxDeliver, nothing is
// dead-lettered, and it settles once Redis takes writes again.
func TestRedisRefusingWritesDeadLettersNothing(t *testing.T) {
	for _, tc := range []struct {
		name, param, refuse, allow string
	}{
		{"OOM", "maxmemory", "1", "0"},
		{"NOREPLICAS", "min-replicas-to-write", "1", "0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			ctx := context.Background()
			rdb := e.redis.Client()
			if err := rdb.ConfigSet(ctx, "maxmemory-policy", "noeviction").Err(); err != nil {
				t.Fatal(err)
			}
			e.cfg.MaxDeliver = 2
			e.start(nil)
			ten, usr, req := "refuse-"+e2e.RandomHex(4), "u1", "r1"
			e.reserve(ten, usr, req, 100, true)
			e.waitStatus(ten, usr, req, "open")

			allow := func() {
				if err := rdb.ConfigSet(ctx, tc.param, tc.allow).Err(); err != nil {
					t.Fatal(err)
				}
			}
			if err := rdb.ConfigSet(ctx, tc.param, tc.refuse).Err(); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(allow)
			e.publish(e.actual(ten, usr, req, "", 40, 0))
			dead := func() uint64 {
				return e.subjectMsgs(e.cfg.DLQStream, events.DLQSubject(e.cfg.SubjectPrefix, stream.ReasonMaxDeliver))
			}
			retries := `quotaflow_accounter_events_total{result="retry",type="quotaflow.usage.actual"}`
			e2e.Eventually(t, "more failed deliveries than MaxDeliver, or a dead letter", func() bool {
				return e.metric(retries) > float64(e.cfg.MaxDeliver) || dead() > 0
			})
			if n := dead(); n != 0 {
				t.Fatalf("%d events dead-lettered while Redis refused writes (%s), want 0", n, tc.name)
			}
			allow()
			e.waitStatus(ten, usr, req, "settled")
			if got := e.used(ten, usr, "5h"); got != 40 {
				t.Errorf("5h used = %d, want 40", got)
			}
		})
	}
}

// A Redis that may evict quota state keeps the accounter ready, with the
// policy named under degraded in /readyz.
func TestEvictingRedisIsReportedNotFatal(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	if err := e.redis.Client().ConfigSet(ctx, "maxmemory-policy", "volatile-lru").Err(); err != nil {
		t.Fatal(err)
	}
	e.start(nil)
	e2e.Eventually(t, "readyz naming volatile-lru", func() bool {
		code, body := e2e.Readyz(e.ops)
		var s obs.Status
		return code == 200 && json.Unmarshal([]byte(body), &s) == nil &&
			strings.Contains(s.Degraded[eviction.Name], "volatile-lru")
	})
}

// At start the accounter deletes the engine library of another release
// from Redis (limits.Limiter.DropOtherEngines).
func TestStartDropsOtherEngines(t *testing.T) {
	e := newEnv(t)
	rdb := e.redis.Client()
	const old = "qf0123456789ab"
	redistest.LoadLibrary(t, rdb, old)
	e.start(nil)
	e2e.EventuallyLast(t, "the other release's library deleted", func() (bool, string) {
		libs := redistest.Libraries(t, rdb, old)
		return len(libs) == 0, fmt.Sprint(libs)
	})
}
