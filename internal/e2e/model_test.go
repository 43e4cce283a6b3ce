package e2e_test

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"net/http"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"quotaflow/internal/e2e"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
	"quotaflow/pkg/limits/repair"
)

// TestPipelineAgreesWithModel runs admission and the accounter as
// processes on a private Redis, the shared Postgres and NATS, and plays
// random sequences of admits (new, identical retries, retries with another
// cost), releases, actual usage published straight to NATS (in any order,
// some of it twice under other message ids, some before the release, some
// after), accounter crashes mid-batch and a Redis loss with decisions made
// locally meanwhile. After each sequence has settled, Redis's windows,
// request counters and slots, the ledger's reservations and the hourly
// rollups must equal a plain model of the rules (docs/design.md §4–§6), every
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
					t.Fatalf("sequence %d: admit %s/%s cost %d = %s, model %s (seed %d)\nanswer: %s", seq, u, id, cost, got, want, seed, p.last)
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
	p.reconcilesClean(t, 0)
}

// pipeline is a stack and what the model test plays on it.
type pipeline struct {
	*stack
	tenant   string
	gw, bill caller // a gateway's and a billing token's
	pub      *stream.Publisher
	last     reply // admission's last answer to an admit
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
	tenant := redistest.UniqueName(t)
	gw, bill := "gw-"+e2e.RandomHex(8), "bill-"+e2e.RandomHex(8)
	s := startStack(t, stackConfig{
		policy: modelPolicy(tenant),
		tokens: []string{gw, bill + "#billing"},
		// A generous Redis timeout: under -race on two busy cores a few
		// milliseconds would send decisions to the local limiter, and the
		// model predicts Redis's exact ones.
		admission: []string{"QF_REDIS_TIMEOUT=2s"},
		accounter: []string{"QF_EPOCH_INTERVAL=200ms", "QF_RECONCILE_INTERVAL=1s", "QF_ACK_WAIT=2s", "QF_WORKERS=2"},
	})
	return &pipeline{stack: s, tenant: tenant, gw: s.as(t, gw), bill: s.as(t, bill), pub: stream.NewPublisher(s.js, s.streams)}
}

func (p *pipeline) topUp(t *testing.T, u string, amount int64) {
	t.Helper()
	if r := p.bill.do(http.MethodPost, "/v1/balances/topup", map[string]any{"tenant": p.tenant, "user": u, "amount": amount, "reference": "seed-" + u}); r.code != 200 {
		t.Fatalf("top up %s: %s", u, r)
	}
}

// admit asks admission and names the answer as the model does.
func (p *pipeline) admit(t *testing.T, u, id string, cost int64) string {
	t.Helper()
	r := p.gw.admit(admitReq{RequestID: id, Tenant: p.tenant, User: u, Endpoint: "/gen", Estimate: cost})
	p.last = r
	switch r.code {
	case 200:
		return "allowed"
	case 429:
		trace(t, "admit %s/%s cost %d denied: %s", u, id, cost, r)
		return "denied"
	case 409:
		return "conflict"
	}
	t.Fatalf("admit %s/%s = %s", u, id, r)
	return ""
}

func (p *pipeline) release(t *testing.T, u, id string) {
	t.Helper()
	if r, _ := p.gw.release(p.tenant, u, id); r.code != 200 && r.code != 202 {
		t.Fatalf("release %s/%s = %s", u, id, r)
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
	if dup {
		b, err := events.Encode(ev)
		if err != nil {
			t.Fatal(err)
		}
		p.publishRaw(t, ev.Type(), "again-"+ev.ID, b)
	}
}

func (p *pipeline) publishRelease(t *testing.T, u, id string) {
	p.publish(t, events.NewReleased("test/llm", events.Released{RequestID: id, Tenant: p.tenant, User: u}, time.Now()), false)
}

// loseRedis crashes Redis, admits locally meanwhile (within the local
// allowance), and brings Redis back empty: the accounter rebuilds it from
// the ledger and admission returns to it.
func (p *pipeline) loseRedis(t *testing.T, m *pmodel, rng *rand.Rand) {
	t.Helper()
	p.redis.Kill()
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
	if err := p.redis.Up(ctx); err != nil {
		t.Fatal(err)
	}
	m.afterLoss()
	// The rebuild first: admission may not have noticed the outage (a
	// short streak of failures does not open its breaker) and would look
	// steady until it meets the missing epoch.
	e2e.EventuallyLast(t, "the epoch rewritten", func() (bool, string) {
		missing, err := repair.EpochMissing(ctx, p.rdb)
		return err == nil && !missing, fmt.Sprint(missing, err)
	})
	if d := p.admission.WaitSteady(ctx, 45*time.Second); d != "" {
		t.Fatalf("admission still degraded after Redis came back: %s", d)
	}
}

// settle waits until the accounter has consumed everything the model
// expects in the ledger; it corrects Redis in the same transactions.
func (p *pipeline) settle(t *testing.T, m *pmodel) {
	t.Helper()
	want := m.ledger()
	e2e.EventuallyLast(t, "the ledger settled", func() (bool, string) {
		got := p.reservations(t)
		return maps.Equal(got, want), fmt.Sprint(diff(got, want))
	})
}

// reservations reads every reservation row of the tenant as "status
// actual local reserved", reserved telling whether its reserved event is
// in: a row the actual event made alone already reads settled, and the
// rollups count it as a request only once its estimate is in.
func (p *pipeline) reservations(t *testing.T) map[string]string {
	t.Helper()
	rows, err := p.db.Query(context.Background(), `SELECT user_id, request_id, status, coalesce(actual_tokens, -1), local, estimated_tokens IS NOT NULL FROM reservations WHERE tenant = $1`, p.tenant)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	var u, id, st string
	var actual int64
	var local, reserved bool
	if _, err := pgx.ForEachRow(rows, []any{&u, &id, &st, &actual, &local, &reserved}, func() error {
		out[u+"/"+id] = fmt.Sprintf("%s %d local=%v reserved=%v", st, actual, local, reserved)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

// check compares Redis, the ledger's events and the rollups with the model.
func (p *pipeline) check(t *testing.T, m *pmodel, seq int) {
	t.Helper()
	for _, u := range slices.Sorted(maps.Keys(m.users)) {
		got := p.gw.usage(p.tenant, u, "")
		for name, want := range m.used(u) {
			if l, ok := got[name]; !ok || l.Used != want {
				t.Errorf("sequence %d: %s %s used = %d, model %d", seq, u, name, l.Used, want)
			}
		}
		if l := got["credits"]; l.Limit != m.user(u).credited {
			t.Errorf("sequence %d: %s credited = %d, model %d", seq, u, l.Limit, m.user(u).credited)
		}
	}
	actuals := p.count(t, `SELECT count(actual_tokens) FROM reservations WHERE tenant = $1`, p.tenant)
	rolled := p.count(t, `SELECT coalesce(sum(tokens), 0)::bigint FROM usage_rollups WHERE tenant = $1`, p.tenant)
	requests := p.count(t, `SELECT coalesce(sum(requests), 0)::bigint FROM usage_rollups WHERE tenant = $1`, p.tenant)
	if tokens, n := m.actuals(); actuals != n || rolled != tokens {
		t.Errorf("sequence %d: ledger %d actual events, rollups %d tokens; model %d tokens in %d", seq, actuals, rolled, tokens, n)
	}
	if n := m.admitted(); requests != n {
		t.Errorf("sequence %d: rollups %d requests; model %d admitted", seq, requests, n)
	}
}

// pmodel is the rules of docs/design.md §4–§6 for the requests of one run.
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

// ledger is every reservation row, as reservations reads them. Every
// request of the model was admitted, through Redis or locally, so its
// reserved event is in the ledger once it has settled.
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
			out[u+"/"+r.id] = fmt.Sprintf("%s %d local=%v reserved=true", st, r.actual, r.local)
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

// admitted is the number of requests admitted, through Redis or locally:
// what the rollups count as requests (docs/design.md §6).
func (m *pmodel) admitted() (n int64) {
	for _, mu := range m.users {
		n += int64(len(mu.reqs))
	}
	return n
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

// trace logs what the run does when QF_MODEL_TRACE is set, to follow a
// failing seed.
func trace(t *testing.T, format string, args ...any) {
	if os.Getenv("QF_MODEL_TRACE") != "" {
		t.Logf(format, args...)
	}
}
