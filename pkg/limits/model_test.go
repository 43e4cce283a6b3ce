package limits_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"testing"
	"time"

	"quotaflow/internal/limitstest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/internal/wire"
	"quotaflow/pkg/limits/policy"
)

// TestEngineAgreesWithModel plays random interleavings of every engine
// operation on two users of one tenant, under every kind of limit, and
// checks after each one that Redis holds exactly what a plain model of the
// rules says (docs/design.md §4): a request id is a key only for the same open
// request; a denial, a duplicate and a conflict charge nothing; a
// settlement moves token limits by actual - estimate and frees slots;
// actual usage wins over a release; a release after an actual changes
// nothing; a voided lost call leaves what the local decision implies; a
// batch of settlements (SettleMany, both users' in one call, an id
// repeated within it) does what they do one after another; and every
// decision allows exactly when every limit has room. QF_MODEL_SEED
// replays a run.
func TestEngineAgreesWithModel(t *testing.T) {
	c := redistest.Shared(t)
	ctx := context.Background()
	seed, rng, l, offset := modelRun(t, c, 7)
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{
		limitstest.Rule(policy.ScopeTenant, policy.Limit{Name: "t5h", Kind: policy.Rolling, Limit: 7000, Window: policy.Duration(5 * time.Hour)}),
		{Limit: policy.Limit{Name: "tslots", Kind: policy.Concurrency, Unit: policy.Requests, Limit: 9}, Scope: policy.ScopeTenant},
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 4000, Window: policy.Duration(5 * time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "day", Kind: policy.Fixed, Limit: 4500, Window: policy.Duration(24 * time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "month", Kind: policy.CalendarMonth, Limit: 5000}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "allowance", Kind: policy.TokenBucket, Burst: 5500, Per: policy.Duration(time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "log", Kind: policy.SlidingLog, Unit: policy.Requests, Limit: 22, Window: policy.Duration(time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "hourly", Kind: policy.Fixed, Unit: policy.Requests, Limit: 24, Window: policy.Duration(time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "requests", Kind: policy.TokenBucket, Unit: policy.Requests, Burst: 23, Per: policy.Duration(time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "credits", Kind: policy.Balance}),
		{Limit: policy.Limit{Name: "slots", Kind: policy.Concurrency, Unit: policy.Requests, Limit: 6}, Scope: policy.ScopeUser},
	}
	m := newModel(rules)
	users := []string{"u1", "u2"}
	for _, u := range users {
		amount := int64(2500 + rng.IntN(2000))
		if _, err := l.TopUp(ctx, tenant, u, &rules[9], amount, "seed-"+u); err != nil {
			t.Fatal(err)
		}
		m.user(u).credited = amount
		// A first request starts the allowances' periods (a token bucket
		// without refill counts from its first use): a charge dated before
		// that would fall outside them, as outside any window.
		if _, err := l.Reserve(ctx, limits.Request{Tenant: tenant, User: u, RequestID: "first", Rules: rules, Fingerprint: 1}); err != nil {
			t.Fatal(err)
		}
		m.reserve(u, "first", 0, 1, 0)
	}

	nonce := int64(0)
	seen := map[string]int{} // outcomes of the reserves, to see what the run covered
	defer func() { t.Logf("reserve outcomes: %v", seen) }()
	for step := range 700 {
		u := users[rng.IntN(len(users))]
		mu := m.user(u)
		// Mostly a request id of the user's past (an open one, where there
		// is, for the settlements to come), else a new one.
		id := "r" + strconv.Itoa(step)
		if open := mu.open(); len(open) > 0 && rng.IntN(2) == 0 {
			id = open[rng.IntN(len(open))]
		} else if ids := mu.ids; len(ids) > 0 && rng.IntN(2) == 0 {
			id = ids[rng.IntN(len(ids))]
		}
		cost := int64(rng.IntN(260))
		what := ""
		nonce++
		req := limits.Request{Tenant: tenant, User: u, RequestID: id, Cost: cost, Rules: rules, Fingerprint: cost + 1, Nonce: nonce}
		if r := mu.recs[id]; r != nil && r.gone {
			// An id whose record expired: only what the accounter would
			// still do (settle an open one, correct a released or void
			// one), with the ledger's copy as the fallback.
			if r.state == stCorrected || r.state == stTomb {
				continue
			}
			actual := int64(rng.IntN(260))
			// dated in Redis's time, as the ledger has it
			fb := &limits.Fallback{ReservedAt: time.Now().Add(offset), Estimate: r.fallbackEstimate()}
			s := limits.Settle{Tenant: tenant, User: u, RequestID: id, Actual: actual, Rules: rules, Fallback: fb}
			var err error
			if r.state != stOpen || rng.IntN(2) == 0 {
				what = fmt.Sprintf("correct gone %s %d", id, actual)
				_, err = l.Correct(ctx, s)
				m.correct(u, id, actual)
			} else {
				what = "release gone " + id
				_, err = l.Release(ctx, s)
				m.release(u, id)
			}
			if err != nil {
				t.Fatalf("step %d %s: %v", step, what, err)
			}
			m.check(t, step, what, limitstest.Peek(t, l, tenant, u, rules), u)
			continue
		}
		switch op := rng.IntN(100); {
		case op < 40: // admit: a new request, or a retry of the same or another
			if r := mu.recs[id]; r != nil && rng.IntN(2) == 0 {
				req.Cost, req.Fingerprint = r.cost, r.fp // an identical retry
			}
			what = fmt.Sprintf("reserve %s cost %d fp %d", id, req.Cost, req.Fingerprint)
			d, err := l.Reserve(ctx, req)
			if err != nil {
				t.Fatalf("step %d %s: %v", step, what, err)
			}
			want := m.reserve(u, id, req.Cost, req.Fingerprint, nonce)
			if got := outcome(d); got != want {
				t.Fatalf("step %d %s = %s, model says %s (seed %d)", step, what, got, want, seed)
			}
			seen[want]++
			if !d.Allowed && d.DeniedBy >= 0 {
				seen["denied by "+d.States[d.DeniedBy].Rule.Name]++
			}
			m.check(t, step, what, d, u)
		case op < 47: // the accounter's batch: settlements of both users in one SettleMany, in order, repeats among them
			what = fmt.Sprintf("settle batch %d:", step)
			var ops []limits.SettleOp
			for k := range 2 + rng.IntN(6) {
				bu := users[rng.IntN(len(users))]
				bid := fmt.Sprintf("orphan-%d-%d", step, k)
				if open := m.user(bu).open(); len(open) > 0 && rng.IntN(3) > 0 {
					bid = open[rng.IntN(len(open))]
				}
				if len(ops) > 0 && rng.IntN(3) == 0 { // a repeat of an earlier settlement's id in the batch
					prev := ops[rng.IntN(len(ops))]
					bu, bid = prev.User, prev.RequestID
				}
				if r := m.user(bu).recs[bid]; r != nil && r.gone {
					continue // settled with the ledger's copy: the lone case above
				}
				o := limits.SettleOp{Settle: limits.Settle{Tenant: tenant, User: bu, RequestID: bid, Rules: rules}, Release: rng.IntN(3) == 0}
				if !o.Release {
					o.Actual = int64(rng.IntN(260))
				}
				what += fmt.Sprintf(" %s/%s release %v actual %d;", bu, bid, o.Release, o.Actual)
				ops = append(ops, o)
			}
			for i, r := range l.SettleMany(ctx, ops) {
				if r.Err != nil {
					t.Fatalf("step %d %s: op %d: %v", step, what, i, r.Err)
				}
			}
			for _, o := range ops {
				if o.Release {
					m.release(o.User, o.RequestID)
				} else {
					m.correct(o.User, o.RequestID, o.Actual)
				}
			}
		case op < 55:
			actual := int64(rng.IntN(260))
			if r := mu.recs[id]; r != nil {
				actual = r.cost * int64(50+rng.IntN(70)) / 100 // estimates are off by -50 % to +20 %
			}
			what = fmt.Sprintf("correct %s %d", id, actual)
			if _, err := l.Correct(ctx, limits.Settle{Tenant: tenant, User: u, RequestID: id, Actual: actual, Rules: rules}); err != nil {
				t.Fatalf("step %d %s: %v", step, what, err)
			}
			m.correct(u, id, actual)
		case op < 70:
			what = "release " + id
			if _, err := l.Release(ctx, limits.Settle{Tenant: tenant, User: u, RequestID: id, Rules: rules}); err != nil {
				t.Fatalf("step %d %s: %v", step, what, err)
			}
			m.release(u, id)
		case op < 80: // a Reserve whose reply is lost, then voided
			if mu.recs[id] != nil {
				continue
			}
			allowed := rng.IntN(2) == 0
			late := rng.IntN(3) == 0 // it reaches Redis only after the void
			what = fmt.Sprintf("lost reserve %s cost %d (local allow %v, late %v)", id, cost, allowed, late)
			void := func() {
				if _, err := l.VoidReserve(ctx, limits.Void{Tenant: tenant, User: u, RequestID: id, Fingerprint: req.Fingerprint, Nonce: nonce, Allowed: allowed}); err != nil {
					t.Fatalf("step %d %s: %v", step, what, err)
				}
			}
			if late {
				void()
				if _, err := l.Reserve(ctx, req); err != nil {
					t.Fatalf("step %d %s: %v", step, what, err)
				}
				m.voidBefore(u, id, req.Cost, req.Fingerprint, allowed)
			} else {
				if _, err := l.Reserve(ctx, req); err != nil {
					t.Fatalf("step %d %s: %v", step, what, err)
				}
				m.reserve(u, id, req.Cost, req.Fingerprint, nonce)
				void()
				m.voidAfter(u, id, req.Cost, req.Fingerprint, allowed)
			}
		case op < 85: // the record expires (its TTL), the reservation lives on in the ledger
			r := mu.recs[id]
			if r == nil || r.gone || r.state == stTomb {
				continue
			}
			what = "expire record " + id
			if err := c.Del(ctx, wire.NewSubjectKeys(tenant, u).Reservation(id)).Err(); err != nil {
				t.Fatal(err)
			}
			r.gone = true
		case op < 88:
			amount := int64(1 + rng.IntN(400))
			what = fmt.Sprintf("top up %d", amount)
			if _, err := l.TopUp(ctx, tenant, u, &rules[9], amount, "ref-"+strconv.Itoa(step)); err != nil {
				t.Fatal(err)
			}
			mu.credited += amount
		default: // usage reported under an id never admitted
			actual := int64(rng.IntN(60))
			id = "orphan-" + strconv.Itoa(step)
			what = fmt.Sprintf("correct orphan %s %d", id, actual)
			if _, err := l.Correct(ctx, limits.Settle{Tenant: tenant, User: u, RequestID: id, Actual: actual, Rules: rules}); err != nil {
				t.Fatalf("step %d %s: %v", step, what, err)
			}
			m.correct(u, id, actual)
		}
		for _, v := range users {
			m.check(t, step, what, limitstest.Peek(t, l, tenant, v, rules), v)
		}
	}
}

// modelRun starts a model test: its seed (QF_MODEL_SEED replays a run),
// the random source of it and stream, and a Limiter over c whose Redis
// time is pinned five minutes into the hour by offset, so no fixed,
// calendar or allowance window turns over during the run.
func modelRun(t *testing.T, c limits.Client, stream uint64) (seed uint64, rng *rand.Rand, l *limits.Limiter, offset time.Duration) {
	seed = uint64(time.Now().UnixNano())
	if s := os.Getenv("QF_MODEL_SEED"); s != "" {
		seed, _ = strconv.ParseUint(s, 10, 64)
	}
	t.Logf("QF_MODEL_SEED=%d", seed)
	offset = 5*time.Minute - time.Duration(time.Now().UnixNano()%int64(time.Hour))
	return seed, rand.New(rand.NewPCG(seed, stream)), limitstest.At(c, offset), offset
}

// Record states of the model, as lib.lua names them.
const (
	stOpen = iota
	stCorrected
	stReleased
	stVoid
	stTomb
)

// mrec is the model of one request id.
type mrec struct {
	state    int
	cost, fp int64
	nonce    int64
	held     int64 // tokens its token limits hold for it
	slot     bool  // it holds a concurrency slot
	gone     bool  // its Redis record expired (the ledger still knows it)
}

// fallbackEstimate is what the ledger's copy says the windows hold: the
// estimate of an open reservation, nothing of a released one, and nothing
// known of a voided one (the ledger has it as local).
func (r *mrec) fallbackEstimate() int64 {
	switch r.state {
	case stOpen:
		return r.cost
	case stReleased:
		return 0
	}
	return limits.NoEstimate
}

type muser struct {
	recs     map[string]*mrec
	ids      []string // of recs, in order
	counted  int64    // admitted requests, as every request limit counts them
	credited int64
}

type model struct {
	rules []policy.Rule
	users map[string]*muser
}

func newModel(rules []policy.Rule) *model { return &model{rules: rules, users: map[string]*muser{}} }

// open lists the ids of open reservations, in order.
func (mu *muser) open() []string {
	var out []string
	for _, id := range mu.ids {
		if r := mu.recs[id]; r != nil && r.state == stOpen {
			out = append(out, id)
		}
	}
	return out
}

// put records r under id.
func (mu *muser) put(id string, r *mrec) {
	if _, ok := mu.recs[id]; !ok {
		mu.ids = append(mu.ids, id)
	}
	mu.recs[id] = r
}

func (m *model) user(u string) *muser {
	if m.users[u] == nil {
		m.users[u] = &muser{recs: map[string]*mrec{}}
	}
	return m.users[u]
}

func (m *model) held(u string) (tokens, slots int64) {
	for _, r := range m.user(u).recs {
		tokens += r.held
		if r.slot {
			slots++
		}
	}
	return tokens, slots
}

func (m *model) tenant() (tokens, slots int64) {
	for u := range m.users {
		t, s := m.held(u)
		tokens, slots = tokens+t, slots+s
	}
	return tokens, slots
}

// reserve applies a Reserve and returns its outcome.
func (m *model) reserve(u, id string, cost, fp, nonce int64) string {
	mu := m.user(u)
	if r := mu.recs[id]; r != nil && !(r.state == stTomb && r.nonce != nonce) {
		switch {
		case r.state == stTomb:
			return "conflict settled"
		case r.state == stCorrected || r.state == stReleased:
			return "conflict settled"
		case r.fp == fp:
			return "duplicate"
		}
		return "conflict request"
	}
	tokens, slots := m.held(u)
	ttokens, tslots := m.tenant()
	fits := ttokens+cost <= 7000 && tslots < 9 && tokens+cost <= 4000 &&
		mu.counted < 22 && tokens+cost <= mu.credited && slots < 6
	if !fits {
		return "denied"
	}
	mu.put(id, &mrec{state: stOpen, cost: cost, fp: fp, nonce: nonce, held: cost, slot: true})
	mu.counted++
	return "allowed"
}

func (m *model) correct(u, id string, actual int64) {
	mu := m.user(u)
	r := mu.recs[id]
	switch {
	case r == nil || r.state == stTomb:
		mu.put(id, &mrec{state: stCorrected, held: actual})
	case r.state == stOpen:
		r.state, r.held, r.slot = stCorrected, actual, false
	case r.state == stReleased, r.state == stVoid:
		r.state, r.held = stCorrected, actual // actual usage always wins
	}
}

func (m *model) release(u, id string) {
	r := m.user(u).recs[id]
	if r == nil || r.state == stTomb || r.state == stCorrected || r.state == stReleased {
		return
	}
	r.state, r.held, r.slot = stReleased, 0, false
}

// voidAfter is VoidReserve after the lost call ran.
func (m *model) voidAfter(u, id string, cost, fp int64, allowed bool) {
	mu := m.user(u)
	r := mu.recs[id]
	switch {
	case r == nil: // Redis denied it: nothing reserved, a marker left
		m.voidBefore(u, id, cost, fp, allowed)
	case allowed:
		r.state, r.held, r.slot = stVoid, 0, false
	default:
		mu.counted--
		delete(mu.recs, id)
	}
}

// voidBefore is VoidReserve before the lost call runs: the call then
// reserves nothing.
func (m *model) voidBefore(u, id string, cost, fp int64, allowed bool) {
	st := stTomb
	if allowed {
		st = stVoid
	}
	m.user(u).put(id, &mrec{state: st, cost: cost, fp: fp})
}

// check compares the limits of d (a decision or a peek of user u) with
// the model.
func (m *model) check(t *testing.T, step int, what string, d limits.Decision, u string) {
	t.Helper()
	tokens, slots := m.held(u)
	ttokens, tslots := m.tenant()
	mu := m.user(u)
	want := []int64{ttokens, tslots, tokens, tokens, tokens, tokens, mu.counted, mu.counted, mu.counted, tokens, slots}
	got := limitstest.Used(d.States)
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("step %d after %s: %s used %v, model %v", step, what, u, got, want)
	}
	if lim := d.States[9].Limit; lim != mu.credited {
		t.Fatalf("step %d after %s: %s credited %d, model %d", step, what, u, lim, mu.credited)
	}
}

// outcome names a Decision as the model does.
func outcome(d limits.Decision) string {
	switch {
	case d.Duplicate:
		return "duplicate"
	case d.Conflict == limits.ConflictRequest:
		return "conflict request"
	case d.Conflict == limits.ConflictSettled:
		return "conflict settled"
	case d.Allowed:
		return "allowed"
	}
	return "denied"
}
