package main

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/internal/config"
	"quotaflow/internal/e2e"
	"quotaflow/internal/natstest"
	"quotaflow/internal/pgtest"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
	"quotaflow/services/alerter/internal/detect"
	"quotaflow/services/alerter/internal/store"
)

// The integration tests run against the real Postgres and NATS of the
// development machine (QF_POSTGRES_URL, QF_NATS_URL override them) and an
// HTTP receiver of their own. Each test owns its database,
// stream and subject prefix.

const testSecret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"

// hit is one request the receiver accepted.
type hit struct {
	id   string
	body detect.Body
	raw  json.RawMessage // data
}

// receiver is a webhook endpoint that verifies signatures independently
// (crypto/hmac), answers status (200 unless set) and keeps each webhook-id
// once, as a deduplicating receiver would.
type receiver struct {
	t        testing.TB
	srv      *httptest.Server
	status   atomic.Int32
	attempts atomic.Int32
	mu       sync.Mutex
	seen     map[string]int // webhook-id -> accepted deliveries
	hits     []hit
	arrived  chan struct{} // a signal per new alert, dropped when full
	// answerDelay delays each accepted answer (nanoseconds).
	answerDelay atomic.Int64
}

func newReceiver(t testing.TB) *receiver {
	r := &receiver{t: t, seen: map[string]int{}, arrived: make(chan struct{}, 1)}
	r.status.Store(http.StatusOK)
	r.srv = httptest.NewServer(http.HandlerFunc(r.serve))
	t.Cleanup(r.srv.Close)
	return r
}

func (r *receiver) serve(w http.ResponseWriter, req *http.Request) {
	r.attempts.Add(1)
	b, _ := io.ReadAll(req.Body)
	key, _ := base64.StdEncoding.DecodeString(strings.TrimPrefix(testSecret, "whsec_"))
	mac := hmac.New(sha256.New, key)
	id := req.Header.Get("webhook-id")
	mac.Write([]byte(id + "." + req.Header.Get("webhook-timestamp") + "." + string(b)))
	want := "v1," + base64.StdEncoding.EncodeToString(mac.Sum(nil))
	if !hmac.Equal([]byte(req.Header.Get("webhook-signature")), []byte(want)) {
		r.t.Errorf("webhook %s: signature %q does not verify", id, req.Header.Get("webhook-signature"))
		w.WriteHeader(http.StatusUnauthorized)
		return
	}
	st := int(r.status.Load())
	if st != http.StatusOK {
		w.WriteHeader(st)
		return
	}
	var body struct {
		detect.Body
		Data json.RawMessage `json:"data"`
	}
	if err := json.Unmarshal(b, &body); err != nil {
		r.t.Errorf("webhook %s: body %s: %v", id, b, err)
	}
	r.mu.Lock()
	r.seen[id]++
	if r.seen[id] == 1 {
		r.hits = append(r.hits, hit{id: id, body: body.Body, raw: body.Data})
		select {
		case r.arrived <- struct{}{}:
		default:
		}
	}
	r.mu.Unlock()
	// A slow answer: the alerter may die before it hears that the
	// receiver has the alert.
	time.Sleep(time.Duration(r.answerDelay.Load()))
}

// of returns the distinct alerts of kind received so far, in order.
func (r *receiver) of(kind string) []hit {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []hit
	for _, h := range r.hits {
		if h.body.Type == kind {
			out = append(out, h)
		}
	}
	return out
}

// env is one test's private world: database, streams, receiver.
type env struct {
	t    testing.TB
	cfg  Config
	pg   *pgxpool.Pool
	js   jetstream.JetStream
	pub  *stream.Publisher
	recv *receiver
	// alerts is the alerts API's address of the last start.
	alerts string
}

func newEnv(t testing.TB, webhooks string) *env {
	t.Helper()

	pgURL := pgtest.NewDatabase(t, "qf_alerter_test")

	_, js := natstest.Connect(t, natstest.URL())
	ec := natstest.Streams(t, js, "alert", stream.Config{AckWait: 2 * time.Second, MaxDeliver: 5})

	recv := newReceiver(t)
	file := filepath.Join(t.TempDir(), "webhooks.yaml")
	writeWebhooks(t, file, webhooks, recv.srv.URL)

	cfg := Config{
		NATS: config.NATS{NATSURL: natstest.URL(), Config: ec}, Postgres: config.Postgres{PostgresURL: pgURL},
		Consumer: "alerter", Log: config.Log{LogLevel: "debug"}, OpsAddr: "127.0.0.1:0", AlertsAddr: "127.0.0.1:0", WebhooksFile: file,
		Hysteresis: 5, SpikeRate: 0.05, SpikeMinRequests: 10, SpikeWindow: 5 * time.Minute,
		EvalInterval: 50 * time.Millisecond, AbuseBurst: 50, AbuseWindow: time.Minute, TopTenants: 10,
		DeliveryTimeout: 2 * time.Second, DeliveryMinBackoff: 20 * time.Millisecond,
		DeliveryMaxBackoff: 100 * time.Millisecond, DeliveryMaxAge: time.Hour, DeliveryPoll: 50 * time.Millisecond, OutboxRetention: 48 * time.Hour,
		ShutdownTimeout: 5 * time.Second,
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	e := &env{t: t, cfg: cfg, js: js, pub: stream.NewPublisher(js, ec), recv: recv}
	return e
}

// writeWebhooks writes the webhooks file, its $URL and $SECRET replaced by
// the receiver's URL and testSecret.
func writeWebhooks(t testing.TB, file, webhooks, url string) {
	t.Helper()
	content := strings.ReplaceAll(webhooks, "$URL", url)
	content = strings.ReplaceAll(content, "$SECRET", testSecret)
	if err := os.WriteFile(file, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}

// writePolicy points e at a policy file of its own (QF_POLICY_FILE) on the
// first call, and writes content there in one rename, so that a running
// alerter reads one whole edit.
func (e *env) writePolicy(content []byte) {
	e.t.Helper()
	if e.cfg.PolicyFile == "" {
		e.cfg.PolicyFile = filepath.Join(e.t.TempDir(), "policy.yaml")
	}
	tmp := e.cfg.PolicyFile + ".tmp"
	if err := os.WriteFile(tmp, content, 0o644); err != nil {
		e.t.Fatal(err)
	}
	if err := os.Rename(tmp, e.cfg.PolicyFile); err != nil {
		e.t.Fatal(err)
	}
}

// start runs an alerter on e until the returned stop is called (or the
// test ends), after /readyz turned 200.
func (e *env) start(logs io.Writer) (stop func()) {
	e.t.Helper()
	if logs == nil {
		logs = io.Discard
	}
	log := slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	ctx, cancel := context.WithCancel(context.Background())
	opsc := make(chan string, 1)
	done := make(chan error, 1)
	alertsc := make(chan string, 1)
	go func() {
		done <- run(ctx, e.cfg, log, hooks{started: func(ops string) { opsc <- ops }, alerts: func(a string) { alertsc <- a }})
	}()
	var ops string
	select {
	case ops = <-opsc:
	case err := <-done:
		cancel()
		e.t.Fatalf("run: %v", err)
	}
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				e.t.Errorf("run: %v", err)
			}
		})
	}
	e.t.Cleanup(stop)
	e2e.Eventually(e.t, "alerter ready", func() bool {
		code, _ := e2e.Readyz(ops)
		return code == http.StatusOK
	})
	e.alerts = <-alertsc // listening before the consumer, so before ready
	if e.pg == nil {
		pool, err := pgxpool.New(context.Background(), e.cfg.PostgresURL)
		if err != nil {
			e.t.Fatal(err)
		}
		e.t.Cleanup(pool.Close)
		e.pg = pool
	}
	return stop
}

func (e *env) publish(evs ...events.Event) {
	e.t.Helper()
	if err := e.pub.PublishBatch(context.Background(), evs); err != nil {
		e.t.Fatal(err)
	}
}

func (e *env) deliveries(kind string) []store.Delivery {
	e.t.Helper()
	ds, err := store.New(e.pg).Deliveries(context.Background(), kind)
	if err != nil {
		e.t.Fatal(err)
	}
	return ds
}

const opsHook = `webhooks:
  - name: ops
    url: $URL
    secret: $SECRET
    allow_private: true
`

func reserved(tenant, user, req string, version, tenantVersion int64, at time.Time, limits ...events.LimitState) events.Event {
	ev := events.NewReserved("test", events.Reserved{
		RequestID: req, Tenant: tenant, User: user, Endpoint: "/api/v1/generate", EstimatedTokens: 1,
		ExpiresAt: at.Add(time.Hour), Version: version, TenantVersion: tenantVersion, Limits: limits,
	}, at)
	ev.Time = at
	return ev
}

func userLimit(used, reset int64) events.LimitState {
	return events.LimitState{Scope: "user", Name: "5h", Unit: "tokens", Limit: 1000, Used: used, Remaining: 1000 - used, ResetSeconds: reset}
}

func thresholds(t *testing.T, hs []hit) []string {
	t.Helper()
	var out []string
	for _, h := range hs {
		var d detect.ThresholdData
		if err := json.Unmarshal(h.raw, &d); err != nil {
			t.Fatal(err)
		}
		out = append(out, fmt.Sprintf("%s/%s %s %d", d.Tenant, d.User, d.LimitName, d.Threshold))
	}
	return out
}

func TestThresholdAlerts(t *testing.T) {
	e := newEnv(t, opsHook+`  - name: other-tenant
    url: $URL
    secret: $SECRET
    tenants: [globex]
    allow_private: true
`)
	logs := &e2e.Buffer{}
	e.start(logs)
	// Event times stand in for the clock; two minutes back, so that the
	// window reset below still lies in the past (consumers refuse events
	// from the future).
	now := time.Now().UTC().Truncate(time.Second).Add(-2 * time.Minute)
	tenantLimit := func(used int64) events.LimitState {
		return events.LimitState{Scope: "tenant", Name: "month", Unit: "tokens", Limit: 100, Used: used, Remaining: 100 - used}
	}
	// Each limit's alerts arrive in order (docs/design.md §7); different limits'
	// may interleave.
	byLimit := func(alerts []string) map[string][]string {
		m := map[string][]string{}
		for _, a := range alerts {
			k := a[:strings.LastIndexByte(a, ' ')]
			m[k] = append(m[k], a)
		}
		return m
	}
	want := func(n int, step string, exp ...string) {
		t.Helper()
		e2e.Eventually(e.t, step, func() bool { return len(e.recv.of(detect.KindThreshold)) >= n })
		got := thresholds(t, e.recv.of(detect.KindThreshold))
		if !maps.EqualFunc(byLimit(got), byLimit(exp), slices.Equal) {
			t.Fatalf("%s: alerts %q, want %q (in this order per limit)", step, got, exp)
		}
	}

	// 70% -> 100%: 80, 90, 100 in order; the tenant limit at 95% fires 80
	// and 90 once for the tenant, whichever user's event carries it.
	e.publish(
		reserved("acme", "u1", "r1", 1, 1, now, userLimit(700, 0), tenantLimit(50)),
		reserved("acme", "u1", "r2", 2, 2, now, userLimit(1000, 0), tenantLimit(95)),
		reserved("acme", "u2", "r3", 1, 3, now, tenantLimit(96)),
		reserved("acme", "u1", "r4", 3, 4, now, userLimit(1000, 0), tenantLimit(97)), // no repeat
	)
	want(5, "first crossings", "acme/u1 5h 80", "acme/u1 5h 90", "acme/u1 5h 100", "acme/ month 80", "acme/ month 90")

	// Falling back re-arms; a stale snapshot (version 3 < 4) is ignored
	// and re-arms nothing; climbing again fires 80 only.
	e.publish(
		reserved("acme", "u1", "r5", 4, 5, now, userLimit(500, 60)),
		reserved("acme", "u1", "r6", 3, 0, now, userLimit(999, 60)), // stale: version 3
		reserved("acme", "u1", "r7", 5, 6, now, userLimit(850, 60)),
	)
	want(6, "re-armed", "acme/u1 5h 80", "acme/u1 5h 90", "acme/u1 5h 100", "acme/ month 80", "acme/ month 90", "acme/u1 5h 80")

	// The window resets (61 s later, past the 60 s reset, usage down 5
	// points): 80 again though usage stayed above 75%.
	e.publish(reserved("acme", "u1", "r8", 6, 7, now.Add(61*time.Second), userLimit(800, 3600)))
	want(7, "window reset", "acme/u1 5h 80", "acme/u1 5h 90", "acme/u1 5h 100", "acme/ month 80", "acme/ month 90", "acme/u1 5h 80", "acme/u1 5h 80")

	// Corrected snapshots count too.
	e.publish(events.NewCorrected("test", events.Corrected{RequestID: "r8", Tenant: "acme", User: "u1", Delta: 100, Version: 7,
		Limits: []events.LimitState{userLimit(920, 3600)}}, now.Add(62*time.Second)))
	want(8, "correction", "acme/u1 5h 80", "acme/u1 5h 90", "acme/u1 5h 100", "acme/ month 80", "acme/ month 90", "acme/u1 5h 80", "acme/u1 5h 80", "acme/u1 5h 90")

	// Payload shape (docs/design.md §7), of the first 100 % alert.
	var first map[string]any
	i := slices.Index(thresholds(t, e.recv.of(detect.KindThreshold)), "acme/u1 5h 100")
	if err := json.Unmarshal(e.recv.of(detect.KindThreshold)[i].raw, &first); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"tenant", "user", "scope", "limit_name", "unit", "threshold", "used", "limit", "percent", "reset_seconds", "occurred_at"} {
		if _, ok := first[k]; !ok {
			t.Errorf("threshold data %v lacks %q", first, k)
		}
	}
	if first["percent"] != 100.0 || first["threshold"] != 100.0 {
		t.Errorf("threshold data = %v, want percent 100 and threshold 100", first)
	}

	// Everything delivered once; the tenant filter kept acme's alerts from
	// the globex-only webhook.
	e2e.Eventually(e.t, "all delivered", func() bool {
		for _, d := range e.deliveries("") {
			if d.Status != store.StatusDelivered {
				return false
			}
		}
		return true
	})
	for _, d := range e.deliveries("") {
		if d.Webhook != "ops" {
			t.Errorf("alert %s queued for webhook %s, which only takes globex", d.AlertID, d.Webhook)
		}
	}
	e.recv.mu.Lock()
	for id, n := range e.recv.seen {
		if n != 1 {
			t.Errorf("webhook-id %s delivered %d times, want 1", id, n)
		}
	}
	e.recv.mu.Unlock()
	if strings.Contains(logs.String(), strings.TrimPrefix(testSecret, "whsec_")) {
		t.Errorf("logs contain the webhook secret")
	}
}

func TestDenialSpikeAndAbuse(t *testing.T) {
	e := newEnv(t, opsHook)
	e.start(nil)
	now := time.Now().UTC()
	denied := func(user, ip, name string, n int64) events.Event {
		return events.NewDenied("test", events.Denied{Tenant: "acme", User: user, IP: ip, Endpoint: "/api/v1/chat",
			Scope: "user", Name: name, Count: n}, now, "test")
	}
	var evs []events.Event
	for i := range 10 {
		ev := reserved("acme", "u1", fmt.Sprintf("a%d", i), int64(i+1), 0, now)
		ev.Data = withEndpoint(ev.Data.(events.Reserved), "/api/v1/chat")
		evs = append(evs, ev)
	}
	evs = append(evs, denied("u1", "", "5h", 5))
	e.publish(evs...)
	spikes := func(n int) []detect.SpikeData {
		e2e.Eventually(e.t, fmt.Sprintf("%d spike alerts", n), func() bool { return len(e.recv.of(detect.KindSpike)) >= n })
		var out []detect.SpikeData
		for _, h := range e.recv.of(detect.KindSpike) {
			var d detect.SpikeData
			if err := json.Unmarshal(h.raw, &d); err != nil {
				t.Fatal(err)
			}
			out = append(out, d)
		}
		return out
	}
	// 5 denials of 15 requests, for the tenant and for the endpoint.
	got := spikes(2)
	for _, d := range got {
		if d.State != detect.StateFiring || d.Denied != 5 || d.Total != 15 || d.WindowSeconds != 300 {
			t.Errorf("spike %+v, want firing with 5 of 15 over 300 s", d)
		}
	}
	if got[0].Tenant+got[0].Endpoint == got[1].Tenant+got[1].Endpoint {
		t.Errorf("spikes %+v, want one for the tenant and one for the endpoint", got)
	}

	// 200 more allowed requests: 5 of 215 is under 5%, both resolve once.
	evs = nil
	for i := range 200 {
		ev := reserved("acme", "u1", fmt.Sprintf("b%d", i), int64(i+20), 0, now)
		ev.Data = withEndpoint(ev.Data.(events.Reserved), "/api/v1/chat")
		evs = append(evs, ev)
	}
	e.publish(evs...)
	got = spikes(4)
	for _, d := range got[2:] {
		if d.State != detect.StateResolved {
			t.Errorf("spike %+v, want resolved", d)
		}
	}

	// A burst of 60 denials from one user and IP: one abuse alert each.
	e.publish(denied("u9", "203.0.113.9", "a", 30), denied("u9", "203.0.113.9", "b", 30))
	e2e.Eventually(e.t, "abuse alerts", func() bool { return len(e.recv.of(detect.KindAbuse)) >= 2 })
	keys := map[string]bool{}
	for _, h := range e.recv.of(detect.KindAbuse) {
		var d detect.AbuseData
		if err := json.Unmarshal(h.raw, &d); err != nil {
			t.Fatal(err)
		}
		keys[d.Key+":"+d.Tenant+"/"+d.User+d.IP] = true
	}
	if !keys["subject:acme/u9"] || !keys["ip:/203.0.113.9"] {
		t.Errorf("abuse alerts %v, want one for acme/u9 and one for 203.0.113.9", keys)
	}
	// No repeat while the burst lasts: let the evaluator (every 50 ms) run
	// a few more rounds, then count.
	time.Sleep(3 * e.cfg.EvalInterval)
	if n := len(e.recv.of(detect.KindAbuse)); n != 2 {
		t.Errorf("%d abuse alerts, want 2", n)
	}
}

func withEndpoint(r events.Reserved, ep string) events.Reserved {
	r.Endpoint = ep
	return r
}

func TestReceiverDownThenUp(t *testing.T) {
	e := newEnv(t, opsHook)
	e.recv.status.Store(http.StatusServiceUnavailable)
	e.start(nil)
	e.publish(reserved("acme", "u1", "r1", 1, 0, time.Now(), userLimit(850, 0)))
	e2e.Eventually(e.t, "failed attempts", func() bool {
		ds := e.deliveries(detect.KindThreshold)
		return len(ds) == 1 && ds[0].Attempts >= 3 && ds[0].LastStatus == http.StatusServiceUnavailable
	})
	e.recv.status.Store(http.StatusOK)
	e2e.Eventually(e.t, "delivered", func() bool {
		ds := e.deliveries(detect.KindThreshold)
		return ds[0].Status == store.StatusDelivered
	})
	if got := thresholds(t, e.recv.of(detect.KindThreshold)); len(got) != 1 || got[0] != "acme/u1 5h 80" {
		t.Errorf("received %q, want the 80%% alert once", got)
	}
}

func TestRestartMidRetry(t *testing.T) {
	e := newEnv(t, opsHook)
	e.recv.status.Store(http.StatusInternalServerError)
	stop := e.start(nil)
	e.publish(reserved("acme", "u1", "r1", 1, 0, time.Now(), userLimit(950, 0)))
	// 80 % is retried; 90 % waits behind it, never attempted, so it
	// cannot overtake it.
	e2e.Eventually(e.t, "retrying", func() bool {
		ds := e.deliveries(detect.KindThreshold)
		return len(ds) == 2 && ds[0].Attempts >= 2
	})
	if ds := e.deliveries(detect.KindThreshold); ds[1].Attempts != 0 {
		t.Errorf("the 90 %% alert was attempted %d times while the 80 %% one awaits its retry", ds[1].Attempts)
	}
	stop()

	// A new instance on the same database and consumer finishes the job
	// and does not raise the alerts again.
	e.recv.status.Store(http.StatusOK)
	e.start(nil)
	e.publish(reserved("acme", "u1", "r2", 2, 0, time.Now(), userLimit(960, 0))) // same state: no alert
	e2e.Eventually(e.t, "delivered", func() bool {
		ds := e.deliveries(detect.KindThreshold)
		return ds[0].Status == store.StatusDelivered && ds[1].Status == store.StatusDelivered
	})
	if got := thresholds(t, e.recv.of(detect.KindThreshold)); strings.Join(got, "|") != "acme/u1 5h 80|acme/u1 5h 90" {
		t.Errorf("received %q, want 80 and 90 once each", got)
	}
	if n := len(e.deliveries("")); n != 2 {
		t.Errorf("%d deliveries queued, want 2", n)
	}
}

func TestPrivateDestinationRefused(t *testing.T) {
	e := newEnv(t, `webhooks:
  - name: strict
    url: $URL
    secret: $SECRET
`)
	e.start(nil)
	e.publish(reserved("acme", "u1", "r1", 1, 0, time.Now(), userLimit(850, 0)))
	e2e.Eventually(e.t, "dead delivery", func() bool {
		ds := e.deliveries(detect.KindThreshold)
		return len(ds) == 1 && ds[0].Status == store.StatusDead
	})
	if d := e.deliveries("")[0]; !strings.Contains(d.LastError, "not a public address") {
		t.Errorf("last_error = %q, want the refusal", d.LastError)
	}
	if n := e.recv.attempts.Load(); n != 0 {
		t.Errorf("receiver on loopback got %d requests, want 0", n)
	}
}
