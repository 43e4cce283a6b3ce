package reconcile

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/internal/natstest"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
	"quotaflow/pkg/limits/repair"
	"quotaflow/services/accounter/internal/ledger"
	"quotaflow/services/accounter/internal/ledgertest"
	"quotaflow/services/accounter/internal/rebuild"
)

// The reconciliation tests run in a ledgertest.World (a private
// redis-server: the scan walks every key) with a NATS stream of their own.

type world struct {
	*ledgertest.World
	rec  *Reconciler
	pub  *stream.Publisher
	cons jetstream.Consumer
}

func newWorld(t testing.TB, repair bool) *world {
	t.Helper()
	lw := ledgertest.New(t)
	_, js := natstest.Connect(t, natstest.URL())
	ec := natstest.Streams(t, js, "reconcile", stream.Config{AckWait: 30 * time.Second, MaxDeliver: 5})
	cons, err := stream.EnsureConsumer(lw.Ctx, js, ec, "accounter")
	if err != nil {
		t.Fatal(err)
	}
	return &world{
		World: lw, pub: stream.NewPublisher(js, ec), cons: cons,
		rec: newReconciler(lw, lw.Store, cons, repair),
	}
}

// newReconciler returns a Reconciler of w's Redis against store, with the
// backlog of cons.
func newReconciler(w *ledgertest.World, store Ledger, cons jetstream.Consumer, repair bool) *Reconciler {
	r, err := New(w.Rep, w.RDB, w.Current, store, ConsumerBacklog{Consumer: cons}, new(rebuild.Gate), repair, slog.New(slog.DiscardHandler), nil)
	if err != nil {
		w.T.Fatal(err)
	}
	return r
}

// charge adds amount to the limits named names of (tenant, user) now, behind
// the ledger's back.
func (w *world) charge(tenant, user string, amount int64, names ...string) {
	w.T.Helper()
	var rules []policy.Rule
	for _, r := range w.Rules(tenant, "/gen") {
		if slices.Contains(names, r.Name) {
			rules = append(rules, r)
		}
	}
	if _, err := w.Rep.Charge(w.Ctx, repair.ChargeRequest{Tenant: tenant, User: user, Rules: rules, Amount: amount}); err != nil {
		w.T.Fatal(err)
	}
}

// used returns what each limit of (tenant, user) on /gen holds, by name.
func (w *world) used(tenant, user string) map[string]int64 {
	w.T.Helper()
	rules := w.Rules(tenant, "/gen")
	d, err := w.Lim.Peek(w.Ctx, limits.Request{Tenant: tenant, User: user, Rules: rules})
	if err != nil {
		w.T.Fatal(err)
	}
	out := map[string]int64{}
	for i, st := range d.States {
		out[rules[i].Name] = st.Used
	}
	return out
}

func (w *world) reconcile(want Drift) {
	w.T.Helper()
	got, err := w.rec.Reconcile(w.Ctx)
	if err != nil {
		w.T.Fatalf("Reconcile = %v", err)
	}
	if got != want {
		w.T.Fatalf("Reconcile = %+v, want %+v", got, want)
	}
}

func wantUsed(t *testing.T, what string, got, want map[string]int64) {
	t.Helper()
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: %s used = %d, want %d (all: %v)", what, k, got[k], v, got)
		}
	}
}

// TestRepairLowersRedisToTheLedger: tokens charged behind the ledger's back
// (a user's limits, a tenant-wide limit, a subject the ledger never saw)
// are taken back on the second scan that sees them, once.
func TestRepairLowersRedisToTheLedger(t *testing.T) {
	w := newWorld(t, true)
	for _, u := range []string{"a", "b"} {
		w.Settle(w.Reserve("acme", u, "/gen", 100, true), 70)
		w.Settle(w.Reserve("acme", u, "", 50, true), 50)
	}
	ledgerA := map[string]int64{"t5h": 240, "5h": 120, "day": 120, "month": 120, "gen1h": 70}
	w.reconcile(Drift{Subjects: 2})
	wantUsed(t, "before", w.used("acme", "a"), ledgerA)

	w.charge("acme", "a", 500, "5h", "day", "month", "gen1h")
	w.charge("acme", "b", 30, "t5h")
	w.charge("other", "x", 9, "5h")
	// Seen once: measured, left alone. Drifted: a, acme, other/x.
	w.reconcile(Drift{Subjects: 3, Drifted: 3, Tokens: 4*500 + 30 + 9})
	wantUsed(t, "after one scan", w.used("acme", "a"), map[string]int64{"t5h": 270, "5h": 620, "gen1h": 570})
	// Seen twice, unchanged, nothing in flight: repaired.
	w.reconcile(Drift{Subjects: 3, Drifted: 3, Tokens: 4*500 + 30 + 9, Repaired: 6, Lowered: 4*500 + 30 + 9})
	wantUsed(t, "after the repair", w.used("acme", "a"), ledgerA)
	wantUsed(t, "after the repair", w.used("acme", "b"), map[string]int64{"t5h": 240, "5h": 120})
	wantUsed(t, "after the repair", w.used("other", "x"), map[string]int64{"5h": 0})
	// other/x's window is empty now (its blob stays till the window ends);
	// nothing drifts any more.
	w.reconcile(Drift{Subjects: 3})
}

// TestRepairRaisesRedisToTheLedger: usage the ledger holds and Redis lost
// comes back, in the bucket of its time.
func TestRepairRaisesRedisToTheLedger(t *testing.T) {
	w := newWorld(t, true)
	w.Settle(w.Reserve("t", "u", "/gen", 100, true), 100)
	// 40 minutes ago, or since midnight UTC when that is nearer, so that
	// the day and the month count it too.
	now := time.Now().UTC()
	at := now.Add(-40 * time.Minute).Truncate(time.Second)
	if midnight := now.Truncate(24 * time.Hour); at.Before(midnight) {
		at = midnight
	}
	w.LedgerOnly("t", "u", "lost", "/gen", at, 300, 250)
	w.reconcile(Drift{Subjects: 1, Drifted: 1, Tokens: 250 * 4})
	w.reconcile(Drift{Subjects: 1, Drifted: 1, Tokens: 250 * 4, Repaired: 4, Raised: 250 * 4})

	rules := w.Rules("t", "/gen")
	_, ws, err := w.Rep.Windows(w.Ctx, "t", "u", rules)
	if err != nil {
		t.Fatal(err)
	}
	for _, win := range ws {
		if win.Used() != 350 {
			t.Errorf("%s used = %d, want 350", win.Rule.Name, win.Used())
		}
		n := repair.BucketOf(win.Rule, at)
		k := slices.IndexFunc(win.Buckets, func(b repair.Bucket) bool { return b.N == n })
		if k < 0 || win.Buckets[k].Used < 250 {
			t.Errorf("%s: the bucket of the lost usage holds too little: %+v", win.Rule.Name, win.Buckets)
		}
	}
	w.reconcile(Drift{Subjects: 1})
}

// TestOpenReservationIsNotTakenBack: an open reservation counts its
// estimate in Redis and in the ledger alike.
func TestOpenReservationIsNotTakenBack(t *testing.T) {
	w := newWorld(t, true)
	w.Reserve("acme", "u", "/gen", 400, true) // no actual yet
	w.Settle(w.Reserve("acme", "u", "", 100, true), 60)
	want := map[string]int64{"t5h": 460, "5h": 460, "day": 460, "month": 460, "gen1h": 400}
	for range 3 {
		w.reconcile(Drift{Subjects: 1})
	}
	wantUsed(t, "after three scans", w.used("acme", "u"), want)
}

// TestNoRepairWhileEventsAreInFlight: a reservation whose event is still in
// the stream looks like drift and is never taken back, and while anything
// is pending nothing else is repaired either; once the event reaches the
// ledger the reservation agrees and the stable drift is repaired.
func TestNoRepairWhileEventsAreInFlight(t *testing.T) {
	w := newWorld(t, true)
	ev := w.Reserve("t", "p", "/chat", 200, false) // an endpoint without limits of its own
	if err := w.pub.Publish(w.Ctx, ev); err != nil {
		t.Fatal(err)
	}
	w.charge("t", "x", 10, "5h")
	w.reconcile(Drift{Subjects: 2, Drifted: 2, Tokens: 3*200 + 10})
	for range 2 { // seen alike, held: 3 limits of p, 1 of x
		w.reconcile(Drift{Subjects: 2, Drifted: 2, Tokens: 3*200 + 10, Held: 4})
	}
	wantUsed(t, "in flight", w.used("t", "p"), map[string]int64{"5h": 200, "day": 200, "month": 200})
	wantUsed(t, "in flight", w.used("t", "x"), map[string]int64{"5h": 10})

	// The accounter consumes it: the ledger, then the ack.
	batch, err := w.cons.Fetch(1, jetstream.FetchMaxWait(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	for m := range batch.Messages() {
		w.Record(ev)
		if err := m.DoubleAck(w.Ctx); err != nil {
			t.Fatal(err)
		}
	}
	w.reconcile(Drift{Subjects: 2, Drifted: 1, Tokens: 10, Repaired: 1, Lowered: 10})
	wantUsed(t, "consumed", w.used("t", "p"), map[string]int64{"5h": 200, "day": 200, "month": 200})
	wantUsed(t, "consumed", w.used("t", "x"), map[string]int64{"5h": 0})
}

// TestReconcileComparesEachOwnerWithItsOwnLedger: subjects read many a
// round trip, over more than one chunk, each with its own usage and drift
// (none for some), among them a tenant-wide limit and subjects only Redis
// knows: exactly the drifted ones are found and each is repaired to its
// own ledger's value.
func TestReconcileComparesEachOwnerWithItsOwnLedger(t *testing.T) {
	w := newWorld(t, true)
	const n, onlyRedis = readChunk + readChunk/2, 10
	at := time.Now().Truncate(time.Second) // the ledger's precision
	var recs []ledger.Record
	var charges []repair.ChargeRequest
	seen, repaired := Drift{Subjects: n + onlyRedis}, Drift{}
	// drifted counts a drift of d tokens (Redis ahead) in nlim limits of
	// one owner.
	drifted := func(d int64, nlim int) {
		if d == 0 {
			return
		}
		seen.Drifted++
		seen.Tokens += int64(nlim) * abs(d)
		repaired.Repaired += nlim
		if d > 0 {
			repaired.Lowered += int64(nlim) * d
		} else {
			repaired.Raised -= int64(nlim) * d
		}
	}
	var acme, acmeDrift int64
	for i := range n {
		tenant, user := "b", fmt.Sprintf("u%04d", i)
		if i%2 == 0 {
			tenant = "acme"
		}
		used, d := int64(100+i), int64(i%5-2)
		recs = append(recs, ledger.Record{EventID: user, Kind: events.TypeReserved, Tenant: tenant, User: user,
			RequestID: "r", Tokens: used, OccurredAt: at, Payload: []byte(`{}`)})
		charges = append(charges, repair.ChargeRequest{Tenant: tenant, User: user, Rules: w.Rules(tenant, ""), Amount: used + d, At: at})
		drifted(d, 3) // 5h, day, month
		if tenant == "acme" {
			acme += used
			acmeDrift += d
		}
	}
	drifted(acmeDrift, 1) // t5h
	for i := range onlyRedis {
		charges = append(charges, repair.ChargeRequest{Tenant: "c", User: fmt.Sprintf("x%d", i), Rules: w.Rules("c", ""), Amount: int64(1 + i), At: at})
		drifted(int64(1+i), 3)
	}
	if _, err := w.Store.Write(w.Ctx, recs); err != nil {
		t.Fatal(err)
	}
	for i, r := range w.Rep.ChargeMany(w.Ctx, charges) {
		if r.Err != nil {
			t.Fatalf("charge %d: %v", i, r.Err)
		}
	}
	w.reconcile(seen)
	repaired.Subjects, repaired.Drifted, repaired.Tokens = seen.Subjects, seen.Drifted, seen.Tokens
	w.reconcile(repaired)
	for _, r := range recs {
		want := map[string]int64{"5h": r.Tokens, "day": r.Tokens, "month": r.Tokens}
		if r.Tenant == "acme" {
			want["t5h"] = acme
		}
		wantUsed(t, r.Tenant+"/"+r.User, w.used(r.Tenant, r.User), want)
		if t.Failed() {
			t.FailNow()
		}
	}
	wantUsed(t, "c/x9", w.used("c", "x9"), map[string]int64{"5h": 0, "day": 0, "month": 0})
	w.reconcile(Drift{Subjects: n + onlyRedis})
}

// TestSaturatedWindowAgrees: windows stop at limits.MaxCost, so a window
// the ledger fills past it agrees once full, and one that Redis holds less
// of is filled to the cap by one repair (more would be refused), after
// which it agrees too.
func TestSaturatedWindowAgrees(t *testing.T) {
	w := newWorld(t, true)
	at := time.Now().UTC().Truncate(time.Second)
	for i := range 3 {
		w.LedgerOnly("t", "full", "f"+strconv.Itoa(i), "", at, limits.MaxCost, limits.MaxCost)
		w.LedgerOnly("t", "short", "s"+strconv.Itoa(i), "", at, limits.MaxCost, limits.MaxCost)
	}
	for range 2 {
		w.charge("t", "full", limits.MaxCost, "5h", "day", "month") // the second saturates
	}
	w.charge("t", "short", 400, "5h")
	room := int64(limits.MaxCost-400) + 2*limits.MaxCost
	w.reconcile(Drift{Subjects: 2, Drifted: 1, Tokens: room})
	w.reconcile(Drift{Subjects: 2, Drifted: 1, Tokens: room, Repaired: 3, Raised: room})
	for _, u := range []string{"full", "short"} {
		wantUsed(t, u, w.used("t", u), map[string]int64{"5h": limits.MaxCost, "day": limits.MaxCost, "month": limits.MaxCost})
	}
	w.reconcile(Drift{Subjects: 2})
}

// TestDriftSeenOnceIsNotRepaired: a drift must be seen unchanged, bucket
// for bucket, by two consecutive scans.
func TestDriftSeenOnceIsNotRepaired(t *testing.T) {
	w := newWorld(t, true)
	w.Settle(w.Reserve("t", "u", "", 100, true), 100)
	w.charge("t", "u", 100, "5h")
	w.reconcile(Drift{Subjects: 1, Drifted: 1, Tokens: 100})
	w.charge("t", "u", 50, "5h") // still moving
	w.reconcile(Drift{Subjects: 1, Drifted: 1, Tokens: 150})
	wantUsed(t, "moving", w.used("t", "u"), map[string]int64{"5h": 250})
	w.reconcile(Drift{Subjects: 1, Drifted: 1, Tokens: 150, Repaired: 1, Lowered: 150})
	wantUsed(t, "repaired", w.used("t", "u"), map[string]int64{"5h": 100})
}

// TestRepairOff only measures.
func TestRepairOff(t *testing.T) {
	w := newWorld(t, false)
	w.charge("t", "u", 100, "5h")
	for range 3 {
		w.reconcile(Drift{Subjects: 1, Drifted: 1, Tokens: 100})
	}
	wantUsed(t, "measured only", w.used("t", "u"), map[string]int64{"5h": 100})
}

// lockHook runs before() just before each TryLock.
type lockHook struct {
	Ledger
	before func()
}

func (h lockHook) TryLock(ctx context.Context, id int64) (func(), bool, error) {
	h.before()
	return h.Ledger.TryLock(ctx, id)
}

// TestTwoInstancesRepairOnce: two instances sharing Redis and the ledger
// both see the drift twice; one repairs it just before the other takes the
// lock, and the other's fresh measurement finds nothing left to repair.
func TestTwoInstancesRepairOnce(t *testing.T) {
	w := newWorld(t, true)
	w.Settle(w.Reserve("t", "u", "", 100, true), 100)
	w.charge("t", "u", 40, "5h")
	seen := Drift{Subjects: 1, Drifted: 1, Tokens: 40}
	var first Drift
	hook := lockHook{Ledger: w.Store, before: func() {
		var err error
		if first, err = w.rec.Reconcile(w.Ctx); err != nil {
			t.Error(err)
		}
	}}
	other := newReconciler(w.World, hook, w.cons, true)
	w.reconcile(seen)
	for i, want := range []Drift{seen, seen} { // the second scan finds it stable
		if d, err := other.Reconcile(w.Ctx); err != nil || d != want {
			t.Fatalf("other Reconcile #%d = %+v, %v; want %+v", i+1, d, err, want)
		}
	}
	if want := (Drift{Subjects: 1, Drifted: 1, Tokens: 40, Repaired: 1, Lowered: 40}); first != want {
		t.Errorf("first instance's Reconcile = %+v, want %+v", first, want)
	}
	wantUsed(t, "repaired once", w.used("t", "u"), map[string]int64{"5h": 100})
}
