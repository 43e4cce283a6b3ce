package e2e_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/internal/e2e"
	"quotaflow/internal/natstest"
	"quotaflow/internal/pgtest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/events"
)

// TestPipelineAgreesWithModel runs admission and the accounter as
// processes on a private Redis, the shared Postgres and NATS, and plays
// random sequences of admits (new, identical retries, retries with another
// cost), releases, actual usage published straight to NATS (in any order,
// some of it twice under other message ids, some before the release, some
// after), accounter crashes mid-batch and a Redis loss with decisions made
// locally meanwhile. After each sequence has settled, Redis's windows,
// request counters and slots, the ledger's reservations and the hourly
// rollups must equal a plain model of the rules (DESIGN §4–§6), every
// decision taken while Redis answered must be the model's, every one taken
// without it within the local allowance, and reconciliation must find
// nothing to repair. QF_MODEL_SEED replays a run.
func TestPipelineAgreesWithModel(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the services")
	}
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("QF_MODEL_SEED"); s != "" {
		seed, _ = strconv.ParseUint(s, 10, 64)
	}
	t.Logf("QF_MODEL_SEED=%d", seed)
	rng := rand.New(rand.NewPCG(seed, 11))
	p := startPipeline(t)
	m := &pmodel{users: map[string]*puser{}}
	for _, u := range []string{"u1", "u2", "u3"} {
		credit := int64(2500 + rng.IntN(1500))
		p.topUp(t, u, credit)
		m.user(u).credited = credit
	}

	faults := []string{"none", "crash", "none", "redis", "crash", "none"}
	for seq, fault := range faults {
		t.Logf("sequence %d: %s", seq, fault)
		if fault == "redis" {
			p.loseRedis(t, m, rng)
		}
		var pending []func() // actual usage and releases published to NATS, played at the end
		for range 12 + rng.IntN(10) {
			u := fmt.Sprintf("u%d", 1+rng.IntN(3))
			mu := m.user(u)
			switch op := rng.IntN(10); {
			case op < 6: // admit: mostly new, sometimes a retry of this sequence's or an older one
				id, cost := fmt.Sprintf("s%d-%d", seq, rng.IntN(1000)), int64(rng.IntN(400))
				if r := mu.pick(rng); r != nil && rng.IntN(3) == 0 {
					id = r.id
					if rng.IntN(2) == 0 {
						cost = r.cost // an identical retry
					}
				}
				want := m.admit(u, id, cost)
				got := p.admit(t, u, id, cost)
				trace(t, "seq %d admit %s/%s cost %d -> %s", seq, u, id, cost, got)
				if got != want {
					t.Fatalf("sequence %d: admit %s/%s cost %d = %s, model %s (seed %d)\naccounter log:\n%s", seq, u, id, cost, got, want, seed,
						e2e.Tail(p.accounter.LogPath, 15))
				}
			case op < 8: // release through admission: applied in Redis at once
				r := mu.pick(rng)
				if r == nil {
					continue
				}
				p.release(t, u, r.id)
				m.release(u, r.id)
				trace(t, "seq %d release %s/%s", seq, u, r.id)
			default: // actual usage, published as a service does; or a service's release
				// Both reach the model when they are published, at the end
				// of the sequence: until then Redis has not seen them.
				r := mu.pick(rng)
				if r == nil {
					continue
				}
				id := r.id
				if r.reported || rng.IntN(5) == 0 {
					pending = append(pending, func() {
						p.publishRelease(t, u, id)
						m.release(u, id)
						trace(t, "seq %d publish release %s/%s", seq, u, id)
					})
					continue
				}
				r.reported = true
				actual := r.cost * int64(40+rng.IntN(80)) / 100
				ev := events.NewActual("test/llm", events.Actual{RequestID: id, Tenant: p.tenant, User: u, InputTokens: actual}, time.Now())
				dup := rng.IntN(4) == 0
				pending = append(pending, func() {
					p.publish(t, ev, dup)
					m.correct(u, id, actual)
					trace(t, "seq %d publish actual %s/%s %d", seq, u, id, actual)
				})
			}
		}
		rng.Shuffle(len(pending), func(i, j int) { pending[i], pending[j] = pending[j], pending[i] })
		for i, f := range pending {
			f()
			if fault == "crash" && i == len(pending)/2 {
				p.accounter.Kill() // mid-batch: its batch is redelivered
				if err := p.accounter.Restart(); err != nil {
					t.Fatal(err)
				}
			}
		}
		p.settle(t, m)
		p.check(t, m, seq)
	}
	p.checkReconciled(t)
}

// pipeline is the processes and the servers of one run.
type pipeline struct {
	dir, tenant, dbURL, api string
	admission, accounter    *e2e.Service
	redis                   *redistest.Server
	js                      jetstream.JetStream
	cfg                     events.Config
	pub                     *events.Publisher
	client                  *http.Client
}

// modelPolicy has a limit of every kind a subject can hold, in windows no
// test run crosses the end of (fixed windows of 400 days, a calendar month
// only away from its end).
func modelPolicy(tenant string) string {
	month := "      - {name: month, kind: calendar_month, limit: 5000}\n"
	if now := time.Now().UTC(); time.Date(now.Year(), now.Month()+1, 1, 0, 0, 0, 0, time.UTC).Sub(now) < 10*time.Minute {
		month = ""
	}
	return `default_plan: m
plans:
  m:
    quotas:
      - {name: 5h, kind: rolling, window: 5h, limit: 4000}
      - {name: long, kind: fixed, window: 9600h, limit: 4500}
` + month + `      - {name: credits, kind: balance}
    rates:
      - {name: requests, kind: fixed, window: 9600h, limit: 40}
      - {name: log, kind: sliding_log, window: 1h, limit: 38}
      - {name: allowance, kind: token_bucket, rate: 0, per: 9600h, burst: 39}
      - {name: inflight, kind: concurrency, limit: 5}
tenants:
  ` + tenant + `: {quotas: [{name: t5h, kind: rolling, window: 5h, limit: 9000}]}
`
}

func startPipeline(t *testing.T) *pipeline {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	p := &pipeline{dir: t.TempDir(), tenant: redistest.UniqueName(t), client: &http.Client{Timeout: 10 * time.Second}}
	bin := builtServices(t)
	p.redis = redistest.Start(t)
	p.dbURL = pgtest.NewDatabase(t, "qf_model")
	_, p.js = natstest.Connect(t, natstest.URL(), nats.Name(t.Name()))
	p.cfg = natstest.Streams(t, p.js, "model", events.Config{})
	p.pub = events.NewPublisher(p.js, p.cfg)
	policy := filepath.Join(p.dir, "policy.yaml")
	if err := os.WriteFile(policy, []byte(modelPolicy(p.tenant)), 0o600); err != nil {
		t.Fatal(err)
	}
	common := []string{
		"QF_REDIS_URL=redis://" + p.redis.Addr + "/0", "QF_NATS_URL=" + natstest.URL(), "QF_POLICY_FILE=" + policy,
		"QF_STREAM=" + p.cfg.Stream, "QF_DLQ_STREAM=" + p.cfg.DLQStream, "QF_SUBJECT_PREFIX=" + p.cfg.SubjectPrefix,
		"QF_STREAM_MAX_AGE=" + p.cfg.MaxAge.String(), "QF_STREAM_DUPLICATES=" + p.cfg.Duplicates.String(),
		"QF_DLQ_MAX_AGE=" + p.cfg.DLQMaxAge.String(), "QF_LOG_LEVEL=warn",
	}
	start := func(name string, env ...string) *e2e.Service {
		port, err := e2e.FreePort()
		if err != nil {
			t.Fatal(err)
		}
		ops := "127.0.0.1:" + strconv.Itoa(port)
		s, err := e2e.Start(name, filepath.Join(bin, name), p.dir, ops, append(append(common, env...), "QF_OPS_ADDR="+ops))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Stop(20 * time.Second) })
		if err := s.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
		return s
	}
	p.accounter = start("accounter", "QF_POSTGRES_URL="+p.dbURL, "QF_BATCH_WAIT=20ms", "QF_EPOCH_INTERVAL=200ms",
		"QF_RECONCILE_INTERVAL=1s", "QF_ACK_WAIT=2s", "QF_WORKERS=2")
	port, err := e2e.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	p.api = "http://127.0.0.1:" + strconv.Itoa(port)
	// A generous Redis timeout: under -race on two busy cores a few
	// milliseconds would send decisions to the local limiter, and the
	// model predicts Redis's exact ones.
	p.admission = start("admission", "QF_ADMISSION_ADDR=127.0.0.1:"+strconv.Itoa(port), "QF_REDIS_TIMEOUT=2s",
		"QF_SPILL_DIR="+filepath.Join(p.dir, "spill"), "QF_API_TOKENS=gw,bill#billing")
	if d := p.admission.WaitSteady(ctx, time.Minute); d != "" {
		t.Fatalf("admission not steady: %s", d)
	}
	return p
}

// call sends an API request with token and returns the status and body.
func (p *pipeline) call(t *testing.T, method, path, token, body string) (int, []byte) {
	t.Helper()
	req, _ := http.NewRequest(method, p.api+path, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := p.client.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

func (p *pipeline) topUp(t *testing.T, u string, amount int64) {
	t.Helper()
	code, b := p.call(t, "POST", "/v1/balances/topup", "bill", fmt.Sprintf(`{"tenant":%q,"user":%q,"amount":%d,"reference":"seed-%s"}`, p.tenant, u, amount, u))
	if code != 200 {
		t.Fatalf("top up %s: %d %s", u, code, b)
	}
}

// admit asks admission and names the answer as the model does.
func (p *pipeline) admit(t *testing.T, u, id string, cost int64) string {
	t.Helper()
	code, b := p.call(t, "POST", "/v1/admit", "gw", fmt.Sprintf(`{"tenant":%q,"user":%q,"request_id":%q,"endpoint":"/gen","estimated_tokens":%d}`, p.tenant, u, id, cost))
	switch code {
	case 200:
		return "allowed"
	case 429:
		if testing.Verbose() {
			t.Logf("admit %s/%s cost %d denied: %s", u, id, cost, b)
		}
		return "denied"
	case 409:
		return "conflict"
	}
	t.Fatalf("admit %s/%s = %d %s", u, id, code, b)
	return ""
}

func (p *pipeline) release(t *testing.T, u, id string) {
	t.Helper()
	if code, b := p.call(t, "POST", "/v1/release", "gw", fmt.Sprintf(`{"tenant":%q,"user":%q,"request_id":%q}`, p.tenant, u, id)); code != 200 && code != 202 {
		t.Fatalf("release %s/%s = %d %s", u, id, code, b)
	}
}

// publish publishes ev to NATS as a service does, and with dup once more
// under another message id, as a replay would: JetStream stores both, the
// accounter must count one.
func (p *pipeline) publish(t *testing.T, ev events.Event, dup bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.pub.Publish(ctx, ev); err != nil {
		t.Fatal(err)
	}
	if !dup {
		return
	}
	b, err := events.Encode(ev)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.js.Publish(ctx, events.Subject(p.cfg.SubjectPrefix, ev.Type()), b, jetstream.WithMsgID("again-"+ev.ID)); err != nil {
		t.Fatal(err)
	}
}

func (p *pipeline) publishRelease(t *testing.T, u, id string) {
	p.publish(t, events.NewReleased("test/llm", events.Released{RequestID: id, Tenant: p.tenant, User: u}, time.Now()), false)
}

// loseRedis stops Redis, admits locally meanwhile (within the local
// allowance), and brings Redis back empty: the accounter rebuilds the
// windows from the ledger and admission returns to Redis.
func (p *pipeline) loseRedis(t *testing.T, m *pmodel, rng *rand.Rand) {
	t.Helper()
	p.redis.Stop()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	m.loss++
	// The local allowance (README, admission configuration): what Redis
	// last said remained of each token limit of a subject (or tenant) this
	// instance has seen, else QF_UNSEEN_ALLOWANCE (1000) for each.
	allowance := func(seen bool, remaining int64) int64 {
		if !seen {
			return 1000
		}
		return max(remaining, 0)
	}
	var tenantLocal int64
	local := map[string]int64{} // tokens allowed locally, per user
	for i := range 8 {
		u := fmt.Sprintf("u%d", 1+rng.IntN(3))
		id, cost := fmt.Sprintf("local-%d-%d", m.loss, i), int64(rng.IntN(300))
		got := p.admit(t, u, id, cost)
		trace(t, "local admit %s/%s cost %d -> %s", u, id, cost, got)
		if got == "allowed" {
			local[u] += cost
			tenantLocal += cost
			m.admitLocal(u, id, cost)
		}
	}
	for u, n := range local {
		mu := m.user(u)
		if a := allowance(mu.decided, mu.remaining); n > a {
			t.Errorf("%s was allowed %d tokens without Redis; its allowance was %d", u, n, a)
		}
	}
	if a := allowance(m.tenantDecided, m.tenantRemaining); tenantLocal > a {
		t.Errorf("the tenant was allowed %d tokens without Redis; its allowance was %d", tenantLocal, a)
	}
	p.redis.Restart()
	m.afterLoss()
	if d := p.admission.WaitSteady(ctx, 45*time.Second); d != "" {
		t.Fatalf("admission still degraded after Redis came back: %s", d)
	}
}

// settle waits until the accounter has consumed everything the model
// expects in the ledger and corrected Redis accordingly.
func (p *pipeline) settle(t *testing.T, m *pmodel) {
	t.Helper()
	ctx := context.Background()
	want := m.ledger()
	deadline := time.Now().Add(60 * time.Second)
	for {
		got, err := p.reservations(ctx)
		if err == nil && maps.Equal(got, want) {
			// Every row as it should be; the Redis corrections came in the
			// same transactions, so they are in place too.
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("ledger never settled: %v\nwant %v\naccounter log:\n%s", err, diff(got, want), e2e.Tail(p.accounter.LogPath, 20))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// reservations reads every reservation row as "status actual".
func (p *pipeline) reservations(ctx context.Context) (map[string]string, error) {
	conn, err := pgx.Connect(ctx, p.dbURL)
	if err != nil {
		return nil, err
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT user_id, request_id, status, coalesce(actual_tokens, -1), local FROM reservations WHERE tenant = $1`, p.tenant)
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	for rows.Next() {
		var u, id, st string
		var actual int64
		var local bool
		if err := rows.Scan(&u, &id, &st, &actual, &local); err != nil {
			return nil, err
		}
		out[u+"/"+id] = fmt.Sprintf("%s %d local=%v", st, actual, local)
	}
	return out, rows.Err()
}

// check compares Redis, the ledger's events and the rollups with the model.
func (p *pipeline) check(t *testing.T, m *pmodel, seq int) {
	t.Helper()
	for _, u := range slices.Sorted(maps.Keys(m.users)) {
		code, b := p.call(t, "GET", "/v1/usage?tenant="+url.QueryEscape(p.tenant)+"&user="+u, "gw", "")
		if code != 200 {
			t.Fatalf("GET /v1/usage %s = %d %s", u, code, b)
		}
		var ans struct {
			Limits []struct {
				Name       string
				Limit      int64
				Used       int64
				Unit, Kind string
			}
		}
		if err := json.Unmarshal(b, &ans); err != nil {
			t.Fatal(err)
		}
		want := m.used(u)
		for _, l := range ans.Limits {
			w, ok := want[l.Name]
			if !ok {
				continue
			}
			if l.Used != w {
				t.Errorf("sequence %d: %s %s used = %d, model %d", seq, u, l.Name, l.Used, w)
			}
			if l.Name == "credits" && l.Limit != m.user(u).credited {
				t.Errorf("sequence %d: %s credited = %d, model %d", seq, u, l.Limit, m.user(u).credited)
			}
		}
	}
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, p.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var actualEvents, rolledTokens, rolledRequests int64
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM usage_events WHERE tenant = $1 AND type = $2`, p.tenant, events.TypeActual).Scan(&actualEvents); err != nil {
		t.Fatal(err)
	}
	if err := conn.QueryRow(ctx, `SELECT coalesce(sum(tokens), 0)::bigint, coalesce(sum(requests), 0)::bigint FROM usage_rollups WHERE tenant = $1`, p.tenant).Scan(&rolledTokens, &rolledRequests); err != nil {
		t.Fatal(err)
	}
	tokens, n := m.actuals()
	if actualEvents != n || rolledTokens != tokens || rolledRequests != n {
		t.Errorf("sequence %d: ledger %d actual events, rollups %d tokens in %d requests; model %d tokens in %d", seq, actualEvents, rolledTokens, rolledRequests, tokens, n)
	}
}

// checkReconciled waits for reconciliation passes and requires that they
// repaired nothing: Redis and the ledger agreed all along.
func (p *pipeline) checkReconciled(t *testing.T) {
	t.Helper()
	runs := func() float64 {
		return metric(t, p.accounter.Ops, `quotaflow_accounter_reconciliations_total{result="ok"}`)
	}
	before := runs()
	deadline := time.Now().Add(30 * time.Second)
	for runs() < before+3 { // a repair needs two equal scans, then a recheck
		if time.Now().After(deadline) {
			t.Fatal("no reconciliation ran within 30s")
		}
		time.Sleep(200 * time.Millisecond)
	}
	if n := metric(t, p.accounter.Ops, "quotaflow_accounter_repaired_tokens_total"); n != 0 {
		t.Errorf("reconciliation repaired %v tokens: Redis and the ledger disagreed", n)
	}
	if n := metric(t, p.accounter.Ops, "quotaflow_accounter_drift_tokens"); n != 0 {
		t.Errorf("reconciliation finds %v tokens of drift", n)
	}
}

// metric sums the samples of name on the ops port at base.
func metric(t *testing.T, base, name string) float64 {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var sum float64
	for _, line := range bytes.Split(b, []byte("\n")) {
		l := string(line)
		if strings.HasPrefix(l, name+" ") || strings.HasPrefix(l, name+"{") || strings.HasSuffix(name, "}") && strings.HasPrefix(l, name) {
			f, _ := strconv.ParseFloat(l[strings.LastIndexByte(l, ' ')+1:], 64)
			sum += f
		}
	}
	return sum
}

// pmodel is the rules of DESIGN §4–§6 for the requests of one run.
type pmodel struct {
	users map[string]*puser
	loss  int // Redis losses so far
	// tenantDecided and tenantRemaining: whether Redis decided on any of
	// the tenant's requests, and what it last said remained of the
	// tenant-wide limit, for the local allowance.
	tenantDecided   bool
	tenantRemaining int64
}

type puser struct {
	reqs     map[string]*preq
	order    []string
	counted  int64 // requests Redis counts (admitted through it since its last loss)
	credited int64
	// decided and remaining: whether Redis decided on any of the user's
	// requests, and what it last said remained of the tightest of the
	// user's token limits, for the local allowance.
	decided   bool
	remaining int64
}

type preq struct {
	id       string
	cost     int64
	local    bool  // admitted without Redis
	slot     bool  // holds a concurrency slot in today's Redis
	actual   int64 // -1 until its reported usage is published
	reported bool  // its usage is on the way
	released bool
}

func (m *pmodel) user(u string) *puser {
	if m.users[u] == nil {
		m.users[u] = &puser{reqs: map[string]*preq{}}
	}
	return m.users[u]
}

// pick returns one of u's requests, or nil.
func (mu *puser) pick(rng *rand.Rand) *preq {
	if len(mu.order) == 0 {
		return nil
	}
	return mu.reqs[mu.order[rng.IntN(len(mu.order))]]
}

// held is what the token windows hold for r: its actual once reported
// (actual usage wins over a release), nothing once released, its estimate
// while open unless it was admitted without Redis.
func (r *preq) held() int64 {
	switch {
	case r.actual >= 0:
		return r.actual
	case r.released || r.local:
		return 0
	}
	return r.cost
}

func (m *pmodel) sums(u string) (tokens, slots int64) {
	for _, r := range m.user(u).reqs {
		tokens += r.held()
		if r.slot {
			slots++
		}
	}
	return tokens, slots
}

func (m *pmodel) tenantTokens() int64 {
	var n int64
	for u := range m.users {
		t, _ := m.sums(u)
		n += t
	}
	return n
}

// admit is the decision Redis makes on an admit.
func (m *pmodel) admit(u, id string, cost int64) string {
	mu := m.user(u)
	if r := mu.reqs[id]; r != nil {
		if r.actual < 0 && !r.released && r.cost == cost {
			return "allowed" // a duplicate: the stored decision
		}
		return "conflict"
	}
	tokens, slots := m.sums(u)
	limit := min(4000, mu.credited)
	tenant := m.tenantTokens()
	fits := tokens+cost <= limit && tenant+cost <= 9000 && mu.counted < 38 && slots < 5
	if fits {
		tokens, tenant = tokens+cost, tenant+cost
	}
	mu.decided, mu.remaining = true, limit-tokens
	m.tenantDecided, m.tenantRemaining = true, 9000-tenant
	if !fits {
		return "denied"
	}
	m.add(u, &preq{id: id, cost: cost, slot: true, actual: -1})
	mu.counted++
	return "allowed"
}

func (m *pmodel) add(u string, r *preq) {
	mu := m.user(u)
	mu.reqs[r.id] = r
	mu.order = append(mu.order, r.id)
}

// admitLocal records an admit allowed without Redis.
func (m *pmodel) admitLocal(u, id string, cost int64) {
	m.add(u, &preq{id: id, cost: cost, local: true, actual: -1})
}

func (m *pmodel) release(u, id string) {
	r := m.user(u).reqs[id]
	if r == nil || r.actual >= 0 || r.released {
		return
	}
	r.released, r.slot = true, false
}

func (m *pmodel) correct(u, id string, actual int64) {
	r := m.user(u).reqs[id]
	if r == nil || r.actual >= 0 {
		return
	}
	r.actual, r.slot = actual, false
}

// afterLoss is what a Redis that came back empty holds after the rebuild:
// the token windows and balances again, no request counted, no slot held.
func (m *pmodel) afterLoss() {
	for _, mu := range m.users {
		mu.counted = 0
		for _, r := range mu.reqs {
			r.slot = false
		}
	}
}

// used is what GET /v1/usage should show for u, by limit name.
func (m *pmodel) used(u string) map[string]int64 {
	tokens, slots := m.sums(u)
	mu := m.user(u)
	return map[string]int64{
		"t5h": m.tenantTokens(), "5h": tokens, "long": tokens, "month": tokens, "credits": tokens,
		"requests": mu.counted, "log": mu.counted, "allowance": mu.counted, "inflight": slots,
	}
}

// ledger is every reservation row, as reservations reads them.
func (m *pmodel) ledger() map[string]string {
	out := map[string]string{}
	for u, mu := range m.users {
		for _, r := range mu.reqs {
			st := "open"
			switch {
			case r.actual >= 0:
				st = "settled"
			case r.released:
				st = "released"
			}
			out[u+"/"+r.id] = fmt.Sprintf("%s %d local=%v", st, r.actual, r.local)
		}
	}
	return out
}

// actuals is the usage reported: tokens and events.
func (m *pmodel) actuals() (tokens, n int64) {
	for _, mu := range m.users {
		for _, r := range mu.reqs {
			if r.actual >= 0 {
				tokens, n = tokens+r.actual, n+1
			}
		}
	}
	return tokens, n
}

// diff lists the rows where got and want differ.
func diff(got, want map[string]string) []string {
	var out []string
	for k, w := range want {
		if got[k] != w {
			out = append(out, fmt.Sprintf("%s: got %q want %q", k, got[k], w))
		}
	}
	for k, g := range got {
		if _, ok := want[k]; !ok {
			out = append(out, fmt.Sprintf("%s: got %q, not in the model", k, g))
		}
	}
	slices.Sort(out)
	return out
}

// builtServices builds the three services once for the package's tests
// and returns their directory.
func builtServices(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		root, err := e2e.ModuleRoot(ctx)
		if err == nil {
			buildDir, err = os.MkdirTemp("", "qf-e2e-bin")
		}
		if err == nil {
			err = e2e.Build(ctx, root, buildDir)
		}
		buildErr = err
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return buildDir
}

var (
	buildOnce sync.Once
	buildDir  string
	buildErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
	os.Exit(code)
}

func trace(t *testing.T, format string, args ...any) {
	if os.Getenv("QF_MODEL_TRACE") != "" {
		t.Logf(format, args...)
	}
}
