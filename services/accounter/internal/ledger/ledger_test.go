package ledger

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"quotaflow/internal/pgtest"
)

// testPool creates a database of the test's own on the development
// Postgres (QF_POSTGRES_URL overrides it), migrates it and drops it at the
// end.
func testPool(t testing.TB) *pgxpool.Pool {
	pool := pgtest.Pool(t, "qf_ledger_test", Migrate)
	if err := Migrate(context.Background(), pool, slog.New(slog.DiscardHandler)); err != nil {
		t.Fatalf("Migrate again: %v", err)
	}
	return pool
}

func TestWriteIsIdempotentAndMergesOutOfOrder(t *testing.T) {
	pool := testPool(t)
	s := New(pool)
	ctx := context.Background()
	at := time.Date(2026, 11, 30, 10, 15, 0, 0, time.UTC)
	actual := Record{EventID: "a1", Kind: kindActual, Tenant: "t", User: "u", RequestID: "r1", Tokens: 40,
		OccurredAt: at.Add(time.Minute), Payload: []byte(`{"x":1}`), Endpoint: "/e"}
	reserved := Record{EventID: "v1", Kind: kindReserved, Tenant: "t", User: "u", RequestID: "r1", Tokens: 100,
		OccurredAt: at, Payload: []byte(`{}`), Plan: "pro", Endpoint: "/gen"}

	// The actual first, twice in one batch (one event under two message ids).
	res, err := s.Write(ctx, []Record{actual, actual})
	if err != nil {
		t.Fatal(err)
	}
	k := Key{Tenant: "t", User: "u", RequestID: "r1"}
	if got := res.Reservations[k]; res.Inserted != 0 || got.Estimate != -1 || got.Actual != 40 || got.Status != StatusOpen {
		t.Fatalf("Write(actual, actual) = %d inserted, row %+v; want 0 (an actual is its reservation row), no estimate, actual 40, open", res.Inserted, got)
	}
	// Then the reserved event, with the actual redelivered beside it.
	res, err = s.Write(ctx, []Record{reserved, actual})
	if err != nil {
		t.Fatal(err)
	}
	got := res.Reservations[k]
	if res.Inserted != 0 || got.Estimate != 100 || got.Actual != 40 || got.Plan != "pro" || got.Endpoint != "/gen" || !got.ReservedAt.Equal(at) {
		t.Fatalf("Write(reserved, actual) = %d inserted, row %+v; want 0 (a reserved event is its reservation row), estimate 100, actual 40, plan pro, /gen, reserved at %v", res.Inserted, got, at)
	}
	// Everything again: nothing changes.
	res, err = s.Write(ctx, []Record{reserved, actual})
	if err != nil || res.Inserted != 0 {
		t.Fatalf("Write again = %d inserted, %v; want 0", res.Inserted, err)
	}
	var tokens, requests int64
	if err := pool.QueryRow(ctx, "SELECT tokens, requests FROM usage_rollups WHERE tenant='t' AND bucket_start=$1", at.Truncate(time.Hour)).Scan(&tokens, &requests); err != nil {
		t.Fatal(err)
	}
	if tokens != 40 || requests != 1 {
		t.Errorf("rollup = %d tokens, %d requests; want 40, 1", tokens, requests)
	}

	// Settling is recorded once and never undone by a later mark.
	if err := s.MarkSettled(ctx, []Mark{{Key: k, Status: StatusSettled}}); err != nil {
		t.Fatal(err)
	}
	if err := s.MarkSettled(ctx, []Mark{{Key: k, Status: StatusReleased}}); err != nil {
		t.Fatal(err)
	}
	res, _ = s.Write(ctx, []Record{actual})
	if st := res.Reservations[k].Status; st != StatusSettled {
		t.Errorf("status = %s, want settled", st)
	}

	// The rebuild sees the actual at the reservation's time.
	var usage []Usage
	if err := s.UsageSince(ctx, at.Add(-time.Hour), func(u Usage) error { usage = append(usage, u); return nil }); err != nil {
		t.Fatal(err)
	}
	if len(usage) != 1 || usage[0].Tokens != 40 || !usage[0].At.Equal(at) || usage[0].Plan != "pro" {
		t.Errorf("UsageSince = %+v, want one usage of 40 at %v on plan pro", usage, at)
	}
}

// TestExpire pages through the expired reservations, each page locked
// until it commits the marks of the rows Redis settled.
func TestExpire(t *testing.T) {
	pool := testPool(t)
	s := New(pool)
	ctx := context.Background()
	now := time.Now()
	cutoff := now.Add(-time.Hour)
	recs := []Record{
		{EventID: "old", Kind: kindReserved, Tenant: "t", User: "u", RequestID: "old", Tokens: 10, OccurredAt: now.Add(-2 * time.Hour), Payload: []byte(`{}`)},
		{EventID: "new", Kind: kindReserved, Tenant: "t", User: "u", RequestID: "new", Tokens: 10, OccurredAt: now, Payload: []byte(`{}`)},
		{EventID: "done-r", Kind: kindReserved, Tenant: "t", User: "u", RequestID: "done", Tokens: 10, OccurredAt: now.Add(-2 * time.Hour), Payload: []byte(`{}`)},
		{EventID: "done-a", Kind: kindActual, Tenant: "t", User: "u", RequestID: "done", Tokens: 5, OccurredAt: now.Add(-2 * time.Hour), Payload: []byte(`{}`)},
		{EventID: "local", Kind: kindReserved, Tenant: "t", User: "u", RequestID: "local", Tokens: 10,
			OccurredAt: now.Add(-90 * time.Minute), Payload: []byte(`{}`), Local: true},
	}
	if _, err := s.Write(ctx, recs); err != nil {
		t.Fatal(err)
	}
	ids := func(rows []Reservation) (out []string) {
		for _, r := range rows {
			out = append(out, r.RequestID)
		}
		return out
	}
	begin := func(after Reservation, limit int) (*Tx, []Reservation) {
		t.Helper()
		tx, rows, err := s.BeginExpired(ctx, cutoff, after, limit)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { tx.Rollback(ctx) }) // a test that failed holding it
		return tx, rows
	}
	tx, rows := begin(Reservation{}, 10)
	if !slices.Equal(ids(rows), []string{"old", "local"}) || rows[0].Local || !rows[1].Local {
		t.Fatalf("BeginExpired = %+v; want old, then local (marked local)", rows)
	}
	if r := rows[0]; r.Estimate != 10 || r.Actual != -1 || r.Status != StatusOpen || !r.At.Equal(r.ReservedAt) {
		t.Errorf("expired row = %+v, want estimate 10, no actual, open, at its reservation", r)
	}
	// Another page meanwhile passes the rows this one holds.
	other, rows2 := begin(Reservation{}, 10)
	if len(rows2) != 0 {
		t.Fatalf("BeginExpired while the rows are locked = %+v; want none", rows2)
	}
	other.Rollback(ctx)
	// A batch bringing old's actual meanwhile waits for the page's commit,
	// and finds old expired.
	batch := make(chan *Tx, 1)
	go func() {
		b, err := s.Begin(ctx, []Record{{EventID: "old-a", Kind: kindActual, Tenant: "t", User: "u", RequestID: "old", Tokens: 5,
			OccurredAt: now, Payload: []byte(`{}`)}})
		if err != nil {
			t.Error(err)
		}
		batch <- b
	}()
	waiting := false
	for deadline := time.Now().Add(5 * time.Second); !waiting && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if err := pool.QueryRow(ctx, "SELECT count(*) > 0 FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'").Scan(&waiting); err != nil {
			t.Error(err)
		}
	}
	if !waiting {
		t.Error("the batch of old's actual did not wait for the page's lock")
	}
	// Redis settled old; local is left open.
	if err := tx.Commit(ctx, []Mark{{Key: rows[0].Key, Status: StatusExpired}}); err != nil {
		t.Error(err)
	}
	if b := <-batch; b != nil {
		if st := b.Result.Reservations[rows[0].Key].Status; st != StatusExpired {
			t.Errorf("status the batch of old's actual found = %s, want expired", st)
		}
		if err := b.Commit(ctx, nil); err != nil {
			t.Fatal(err)
		}
	}
	tx, rows = begin(Reservation{}, 10)
	if !slices.Equal(ids(rows), []string{"local"}) {
		t.Fatalf("BeginExpired after the commit = %v; want local alone", ids(rows))
	}
	tx.Rollback(ctx)
	var st string
	if err := pool.QueryRow(ctx, "SELECT status FROM reservations WHERE request_id = 'old'").Scan(&st); err != nil || st != StatusExpired {
		t.Errorf("status of old = %q, %v; want expired", st, err)
	}

	// Pages go on after the last row of the one before, in the order of
	// (reserved_at, key): the rows a pass leaves open are passed.
	var more []Record
	for _, id := range []string{"p2", "p1", "p3"} { // p1 and p2 reserved at once
		at := now.Add(-3 * time.Hour)
		if id == "p3" {
			at = at.Add(time.Second)
		}
		more = append(more, Record{EventID: id, Kind: kindReserved, Tenant: "t", User: "u", RequestID: id, Tokens: 10,
			OccurredAt: at, Payload: []byte(`{}`)})
	}
	if _, err := s.Write(ctx, more); err != nil {
		t.Fatal(err)
	}
	var got []string
	for after := (Reservation{}); ; {
		tx, page := begin(after, 1)
		tx.Rollback(ctx)
		if len(page) == 0 {
			break
		}
		got, after = append(got, page[0].RequestID), page[0]
	}
	if want := []string{"p1", "p2", "p3", "local"}; !slices.Equal(got, want) {
		t.Errorf("pages of one = %v, want %v", got, want)
	}
}

// TestUsageOf reads one subject, or every user of one tenant, and nothing
// of other tenants.
func TestUsageOf(t *testing.T) {
	s := New(testPool(t))
	ctx := context.Background()
	at := time.Date(2026, 11, 30, 10, 15, 0, 0, time.UTC)
	var recs []Record
	for i, sub := range [][2]string{{"t", "a"}, {"t", "b"}, {"t2", "a"}} {
		recs = append(recs, Record{EventID: "v" + sub[0] + sub[1], Kind: kindReserved, Tenant: sub[0], User: sub[1],
			RequestID: "r", Tokens: int64(10 * (i + 1)), OccurredAt: at, Payload: []byte(`{}`)})
	}
	if _, err := s.Write(ctx, recs); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		tenant, user string
		want         int64
	}{{"t", "a", 10}, {"t", "b", 20}, {"t", "", 30}, {"t2", "", 30}, {"t3", "", 0}} {
		var got int64
		err := s.UsageOf(ctx, at.Add(-time.Hour), tc.tenant, tc.user, func(u Usage) error {
			if u.Tenant != tc.tenant || (tc.user != "" && u.User != tc.user) {
				t.Errorf("UsageOf(%s, %s) read %s/%s", tc.tenant, tc.user, u.Tenant, u.User)
			}
			got += u.Tokens
			return nil
		})
		if err != nil || got != tc.want {
			t.Errorf("UsageOf(%s, %q) = %d tokens, %v; want %d", tc.tenant, tc.user, got, err, tc.want)
		}
	}
}

func TestTxCommitsOrLeavesNothing(t *testing.T) {
	pool := testPool(t)
	s := New(pool)
	ctx := context.Background()
	at := time.Date(2026, 11, 30, 10, 15, 0, 0, time.UTC)
	k := Key{Tenant: "t", User: "u", RequestID: "r1"}
	recs := []Record{{EventID: "a1", Kind: kindActual, Tenant: "t", User: "u", RequestID: "r1", Tokens: 40, OccurredAt: at, Payload: []byte(`{}`)}}
	count := func(q string) (n int64) {
		t.Helper()
		if err := pool.QueryRow(ctx, q).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	tx, err := s.Begin(ctx, recs)
	if err != nil || tx.Result.Reservations[k].Actual != 40 || tx.Result.Reservations[k].Status != StatusOpen {
		t.Fatalf("Begin = %+v, %v; want actual 40, open", tx, err)
	}
	tx.Rollback(ctx)
	if n := count("SELECT count(*) FROM usage_events") + count("SELECT count(*) FROM reservations"); n != 0 {
		t.Fatalf("%d rows after Rollback, want 0", n)
	}

	tx, err = s.Begin(ctx, recs)
	if err != nil || tx.Result.Reservations[k].Actual != 40 {
		t.Fatalf("Begin again = %+v, %v; want actual 40", tx, err)
	}
	if err := tx.Commit(ctx, []Mark{{Key: k, Status: StatusSettled}}); err != nil {
		t.Fatal(err)
	}
	tx.Rollback(ctx) // after Commit: nothing
	if n := count("SELECT count(*) FROM reservations WHERE status = 'settled'"); n != 1 {
		t.Errorf("settled reservations = %d, want 1", n)
	}
	if n := count("SELECT sum(tokens) FROM usage_rollups"); n != 40 {
		t.Errorf("rolled up tokens = %d, want 40", n)
	}
	// The connections went back to the pool clean: the next batch on any
	// of them starts its own transaction.
	for range 3 {
		if _, err := s.Write(ctx, recs); err != nil {
			t.Fatal(err)
		}
	}
	if n := count("SELECT sum(tokens) FROM usage_rollups"); n != 40 {
		t.Errorf("rolled up tokens after redeliveries = %d, want 40", n)
	}
}

// Workers write batches that share reservations: a request's reserved and
// actual events often land in concurrent batches. Every batch must commit:
// a deadlock would fail a whole batch and stall its peers for Postgres's
// deadlock_timeout. (A version that wrote each reservation once, locking
// visible rows, then inserting, then locking rows inserted meanwhile, failed
// 62 of 1,689 batches here; one upsert in key order cannot deadlock.) Every
// row a committed batch finished is finished, every other one open.
func TestConcurrentBatchesOfSharedReservationsCommit(t *testing.T) {
	pool := testPool(t)
	s := New(pool)
	ctx := context.Background()
	at := time.Date(2026, 11, 30, 10, 15, 0, 0, time.UTC)
	const workers, rounds, keys = 6, 80, 4
	var mu sync.Mutex
	var failures []error
	finished := map[Key]bool{}
	seq := 0
	for round := range rounds {
		var wg sync.WaitGroup
		start := make(chan struct{})
		for w := range workers {
			rng := rand.New(rand.NewPCG(uint64(round), uint64(w)))
			var recs []Record
			for k := range keys {
				if rng.IntN(2) == 0 {
					continue
				}
				seq++
				recs = append(recs, Record{EventID: fmt.Sprintf("e%d", seq),
					Kind:   []string{kindReserved, kindActual, kindReleased}[rng.IntN(3)],
					Tenant: "t", User: "u", RequestID: fmt.Sprintf("r%d-%d", round, k), Tokens: 10, OccurredAt: at, Payload: []byte(`{}`)})
			}
			rng.Shuffle(len(recs), func(i, j int) { recs[i], recs[j] = recs[j], recs[i] })
			if len(recs) == 0 {
				continue
			}
			wg.Go(func() {
				<-start
				tx, err := s.Begin(ctx, recs)
				if err != nil {
					mu.Lock()
					failures = append(failures, err)
					mu.Unlock()
					return
				}
				// Mark what the consumer would: each open reservation by its
				// first actual or released record.
				var marks []Mark
				seen := map[Key]bool{}
				for _, r := range recs {
					k := Key{Tenant: r.Tenant, User: r.User, RequestID: r.RequestID}
					if r.Kind == kindReserved || seen[k] {
						continue
					}
					seen[k] = true
					if tx.Result.Reservations[k].Status == StatusOpen {
						st := StatusSettled
						if r.Kind == kindReleased {
							st = StatusReleased
						}
						marks = append(marks, Mark{Key: k, Status: st})
					}
				}
				time.Sleep(time.Duration(rng.IntN(2000)) * time.Microsecond) // the Redis phase
				err = tx.Commit(ctx, marks)
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					failures = append(failures, err)
					return
				}
				for k := range seen {
					finished[k] = true
				}
			})
		}
		close(start)
		wg.Wait()
	}
	for _, err := range failures {
		t.Errorf("batch failed: %v", err)
	}
	rows, err := pool.Query(ctx, "SELECT request_id, status FROM reservations")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var req, st string
		if err := rows.Scan(&req, &st); err != nil {
			t.Fatal(err)
		}
		if want := finished[Key{Tenant: "t", User: "u", RequestID: req}]; want != (st != StatusOpen) {
			t.Errorf("%s: status %s, finished by a committed batch: %v", req, st, want)
		}
	}
}

// A reserved event is recorded as its reservation row alone: no
// usage_events row, and its redeliveries, alone, twice in one batch or in a
// batch formed differently, change nothing. Another tenant's event with the
// same id is its own reservation.
func TestReservedEventIsItsReservation(t *testing.T) {
	pool := testPool(t)
	s := New(pool)
	ctx := context.Background()
	at := time.Date(2026, 11, 30, 10, 15, 0, 0, time.UTC)
	reserved := func(tenant string) Record {
		return Record{EventID: "v1", Kind: kindReserved, Tenant: tenant, User: "u", RequestID: "r1", Tokens: 100,
			OccurredAt: at, Payload: []byte(`{"big":"snapshot"}`), Plan: "pro", Endpoint: "/gen", Model: "m"}
	}
	other := Record{EventID: "a2", Kind: kindActual, Tenant: "t", User: "u", RequestID: "r2", Tokens: 7, OccurredAt: at, Payload: []byte(`{}`)}
	type row struct {
		plan, endpoint, model, status string
		estimate                      int64
		reservedAt                    time.Time
	}
	read := func(tenant string) (r row) {
		t.Helper()
		err := pool.QueryRow(ctx, `SELECT plan, endpoint, model, status, estimated_tokens, reserved_at
			FROM reservations WHERE tenant = $1 AND request_id = 'r1'`, tenant).
			Scan(&r.plan, &r.endpoint, &r.model, &r.status, &r.estimate, &r.reservedAt)
		if err != nil {
			t.Fatal(err)
		}
		r.reservedAt = r.reservedAt.UTC()
		return r
	}
	want := row{plan: "pro", endpoint: "/gen", model: "m", status: StatusOpen, estimate: 100, reservedAt: at}
	for i, batch := range [][]Record{{reserved("t")}, {reserved("t"), reserved("t")}, {other, reserved("t")}, {reserved("t"), reserved("t2")}} {
		res, err := s.Write(ctx, batch)
		if err != nil {
			t.Fatal(err)
		}
		if got := res.Reservations[Key{Tenant: "t", User: "u", RequestID: "r1"}]; got.Estimate != 100 || got.Status != StatusOpen || !got.ReservedAt.Equal(at) {
			t.Errorf("batch %d: reservation %+v, want estimate 100, open, reserved at %v", i, got, at)
		}
		if got := read("t"); got != want {
			t.Errorf("batch %d: row %+v, want %+v", i, got, want)
		}
	}
	if got := read("t2"); got != want {
		t.Errorf("the other tenant's row %+v, want %+v", got, want)
	}
	var reservedRows, rows, reservations int64
	if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE type = 'quotaflow.usage.reserved'), count(*),
		(SELECT count(*) FROM reservations) FROM usage_events`).Scan(&reservedRows, &rows, &reservations); err != nil {
		t.Fatal(err)
	}
	if reservedRows != 0 || rows != 0 || reservations != 3 {
		t.Errorf("usage_events: %d reserved rows of %d, %d reservations; want 0 of 0 (an actual is its reservation too), 3", reservedRows, rows, reservations)
	}
}

// Of a request's reserved and released events in one batch, only the
// first of each kind is written (design §6), as across batches: a second
// under another id merges nothing in.
func TestBatchKeepsTheFirstOfEachKind(t *testing.T) {
	pool := testPool(t)
	ctx := context.Background()
	at := time.Date(2026, 11, 30, 10, 15, 0, 0, time.UTC)
	rec := func(id, kind string, d time.Duration, plan string, local bool) Record {
		return Record{EventID: id, Kind: kind, Tenant: "t", User: "u", RequestID: "r1", Tokens: 100, OccurredAt: at.Add(d),
			Payload: []byte(`{}`), Plan: plan, Local: local}
	}
	batch := []Record{
		rec("v1", kindReserved, 0, "pro", false), rec("v2", kindReserved, -time.Minute, "zz", true),
		rec("x1", kindReleased, 2*time.Minute, "", false), rec("x2", kindReleased, time.Minute, "", false),
	}
	if _, err := New(pool).Write(ctx, batch); err != nil {
		t.Fatal(err)
	}
	var plan string
	var local bool
	var reservedAt, releasedAt time.Time
	if err := pool.QueryRow(ctx, `SELECT plan, local, reserved_at, released_at FROM reservations`).
		Scan(&plan, &local, &reservedAt, &releasedAt); err != nil {
		t.Fatal(err)
	}
	if plan != "pro" || local || !reservedAt.Equal(at) || !releasedAt.Equal(at.Add(2*time.Minute)) {
		t.Errorf("row: plan %q, local %v, reserved %v, released %v; want the first events': pro, false, %v, %v",
			plan, local, reservedAt, releasedAt, at, at.Add(2*time.Minute))
	}
}

// An open reservation's actual is written settled at once; Commit keeps
// that when the consumer's marks settle it, sets the mark's status when it
// is a release, and puts the row back to open, the actual recorded, when
// no mark came (Redis did not take the correction): its redelivery settles
// it then. A row settled or released before is never touched ahead.
func TestWriteSettlesAheadAndCommitPutsBack(t *testing.T) {
	pool := testPool(t)
	s := New(pool)
	ctx := context.Background()
	at := time.Date(2026, 11, 30, 10, 15, 0, 0, time.UTC)
	key := func(id string) Key { return Key{Tenant: "t", User: "u", RequestID: id} }
	actual := func(id string) Record {
		return Record{EventID: "a-" + id, Kind: kindActual, Tenant: "t", User: "u", RequestID: id, Tokens: 40, OccurredAt: at, Payload: []byte(`{}`)}
	}
	var recs []Record
	for _, id := range []string{"marked", "released", "failed", "new", "was-released"} {
		if id != "new" {
			recs = append(recs, Record{EventID: "v-" + id, Kind: kindReserved, Tenant: "t", User: "u", RequestID: id, Tokens: 100, OccurredAt: at})
		}
	}
	if _, err := s.Write(ctx, recs); err != nil {
		t.Fatal(err)
	}
	if err := s.MarkSettled(ctx, []Mark{{Key: key("was-released"), Status: StatusReleased}}); err != nil {
		t.Fatal(err)
	}
	type row struct {
		status  string
		actual  *int64
		settled bool
	}
	read := func() map[string]row {
		t.Helper()
		rows, err := pool.Query(ctx, "SELECT request_id, status, actual_tokens, settled_at IS NOT NULL FROM reservations")
		if err != nil {
			t.Fatal(err)
		}
		m := map[string]row{}
		var id string
		var r row
		if _, err := pgx.ForEachRow(rows, []any{&id, &r.status, &r.actual, &r.settled}, func() error { m[id] = r; r = row{}; return nil }); err != nil {
			t.Fatal(err)
		}
		return m
	}

	tx, err := s.Begin(ctx, []Record{actual("marked"), actual("released"), actual("failed"), actual("new"), actual("was-released")})
	if err != nil {
		t.Fatal(err)
	}
	for id, want := range map[string]string{"marked": StatusOpen, "released": StatusOpen, "failed": StatusOpen, "new": StatusOpen, "was-released": StatusReleased} {
		if got := tx.Result.Reservations[key(id)].Status; got != want {
			t.Errorf("Begin: %s status = %s, want %s (the status before the batch)", id, got, want)
		}
	}
	err = tx.Commit(ctx, []Mark{{Key: key("marked"), Status: StatusSettled}, {Key: key("released"), Status: StatusReleased},
		{Key: key("new"), Status: StatusSettled}, {Key: key("was-released"), Status: StatusSettled}})
	if err != nil {
		t.Fatal(err)
	}
	forty := int64(40)
	want := map[string]row{
		"marked":       {StatusSettled, &forty, true},
		"released":     {StatusReleased, &forty, true},
		"failed":       {StatusOpen, &forty, false},
		"new":          {StatusSettled, &forty, true},
		"was-released": {StatusSettled, &forty, true},
	}
	check := func(when string) {
		t.Helper()
		got := read()
		for id, w := range want {
			g := got[id]
			if g.status != w.status || g.settled != w.settled || g.actual == nil || *g.actual != *w.actual {
				t.Errorf("%s: %s = {%s actual %v settled %v}, want {%s actual %d settled %v}", when, id, g.status, g.actual, g.settled, w.status, *w.actual, w.settled)
			}
		}
	}
	check("after the commit")

	// Every actual again: the failed one is open and settles now; the
	// others are left as they are, marks or not.
	tx, err = s.Begin(ctx, []Record{actual("marked"), actual("released"), actual("failed"), actual("new")})
	if err != nil {
		t.Fatal(err)
	}
	if got := tx.Result.Reservations[key("failed")].Status; got != StatusOpen {
		t.Errorf("redelivery: failed status = %s, want open", got)
	}
	if got := tx.Result.Reservations[key("marked")].Status; got != StatusSettled {
		t.Errorf("redelivery: marked status = %s, want settled", got)
	}
	if err := tx.Commit(ctx, []Mark{{Key: key("failed"), Status: StatusSettled}}); err != nil {
		t.Fatal(err)
	}
	want["failed"] = row{StatusSettled, &forty, true}
	check("after the redelivery")
}

// A batch whose connection dies between its write and its commit (the
// accounter crashed) leaves nothing: the reservation it settled ahead is
// open again, without its actual, and the redelivered batch settles it.
func TestCrashBetweenWriteAndCommitLeavesNothing(t *testing.T) {
	pool := testPool(t)
	s := New(pool)
	ctx := context.Background()
	at := time.Date(2026, 11, 30, 10, 15, 0, 0, time.UTC)
	k := Key{Tenant: "t", User: "u", RequestID: "r1"}
	if _, err := s.Write(ctx, []Record{{EventID: "v1", Kind: kindReserved, Tenant: "t", User: "u", RequestID: "r1", Tokens: 100, OccurredAt: at}}); err != nil {
		t.Fatal(err)
	}
	batch := []Record{{EventID: "a1", Kind: kindActual, Tenant: "t", User: "u", RequestID: "r1", Tokens: 40, OccurredAt: at, Payload: []byte(`{}`)}}
	tx, err := s.Begin(ctx, batch)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.conn.Conn().Close(ctx); err != nil { // no ROLLBACK: the server sees the connection go
		t.Fatal(err)
	}
	tx.conn.Release()
	tx.conn = nil
	var status string
	var actual *int64
	var events int64
	read := func() {
		t.Helper()
		if err := pool.QueryRow(ctx, "SELECT status, actual_tokens, count(actual_event) OVER () FROM reservations").Scan(&status, &actual, &events); err != nil {
			t.Fatal(err)
		}
	}
	read()
	if status != StatusOpen || actual != nil || events != 0 {
		t.Fatalf("after the crash: %s, actual %v, %d events; want open, no actual, 0", status, actual, events)
	}
	tx, err = s.Begin(ctx, batch)
	if err != nil {
		t.Fatal(err)
	}
	if got := tx.Result.Reservations[k].Status; got != StatusOpen {
		t.Fatalf("redelivered batch: status %s, want open", got)
	}
	if err := tx.Commit(ctx, []Mark{{Key: k, Status: StatusSettled}}); err != nil {
		t.Fatal(err)
	}
	read()
	if status != StatusSettled || actual == nil || *actual != 40 || events != 1 {
		t.Errorf("after the redelivery: %s, actual %v, %d events; want settled, 40, 1", status, actual, events)
	}
}

// An actual event is recorded in its reservation row alone: its cost and
// its JSON (actual_event), no usage_events row. The first actual of a
// request decides, in a batch as across batches, as the consumer's Redis
// correction does: another actual of the request under another event id
// (a re-report with other figures) and redeliveries change nothing. The
// audit read parses the stored JSON; the rollups count the request once.
func TestActualIsItsReservation(t *testing.T) {
	pool := testPool(t)
	s := New(pool)
	ctx := context.Background()
	at := time.Date(2026, 11, 30, 10, 15, 0, 0, time.UTC)
	actual := func(tenant, id string, tokens int64) Record {
		return Record{EventID: id, Kind: kindActual, Tenant: tenant, User: "u", RequestID: "r1", Tokens: tokens,
			OccurredAt: at, Payload: []byte(fmt.Sprintf(`{"id":%q,"tokens":%d}`, id, tokens)), Endpoint: "/e"}
	}
	first, other := actual("t", "a1", 40), actual("t", "a2", 90)
	for i, batch := range [][]Record{{first, other}, {other}, {first}, {other, first}, {actual("t2", "a1", 7)}} {
		res, err := s.Write(ctx, batch)
		if err != nil {
			t.Fatal(err)
		}
		if res.Inserted != 0 {
			t.Errorf("batch %d: %d usage_events rows inserted, want 0", i, res.Inserted)
		}
		if got := res.Reservations[Key{Tenant: "t", User: "u", RequestID: "r1"}]; i < 4 && got.Actual != 40 {
			t.Errorf("batch %d: actual %d, want 40 (the first)", i, got.Actual)
		}
	}
	var id string
	var tokens, events int64
	if err := pool.QueryRow(ctx, `SELECT convert_from(actual_event, 'UTF8')::jsonb->>'id', actual_tokens,
		(SELECT count(*) FROM usage_events) FROM reservations WHERE tenant = 't'`).Scan(&id, &tokens, &events); err != nil {
		t.Fatal(err)
	}
	if id != "a1" || tokens != 40 || events != 0 {
		t.Errorf("row: actual_event of %q, %d tokens, %d usage_events rows; want a1, 40, 0", id, tokens, events)
	}
	var requests int64
	if err := pool.QueryRow(ctx, "SELECT tokens, requests FROM usage_rollups WHERE tenant = 't'").Scan(&tokens, &requests); err != nil {
		t.Fatal(err)
	}
	// requests counts admitted requests: this one's reserved event never came.
	if tokens != 40 || requests != 0 {
		t.Errorf("rollup = %d tokens, %d requests; want 40, 0", tokens, requests)
	}
	if err := pool.QueryRow(ctx, "SELECT actual_tokens FROM reservations WHERE tenant = 't2'").Scan(&tokens); err != nil || tokens != 7 {
		t.Errorf("the other tenant's actual = %d, %v; want 7 (its own row)", tokens, err)
	}
}

// A batch's write finds its requests' keys by reservation_keys' index,
// however much the table grew since the statement's plan was made: a plan
// cached while the table was small (Postgres keeps a prepared statement's
// generic plan until an ANALYZE) must not read the whole table per batch,
// as a hash join of the batch with the table does (the pipeline bench's
// writes took 7 ms with the index, 82 ms with such a plan at 77k keys).
func TestWriteFindsKeysByIndex(t *testing.T) {
	ctx := context.Background()
	pool, plans := pgtest.Plans(t, "qf_ledger_plan", Migrate)
	if _, err := pool.Exec(ctx, `ALTER TABLE reservation_keys SET (autovacuum_enabled = off)`); err != nil {
		t.Fatal(err)
	}
	s := New(pool)
	at := time.Now().UTC()
	batch := func(from int) []Record {
		var recs []Record
		for i := from; i < from+20; i++ {
			id := fmt.Sprintf("r%d", i)
			recs = append(recs,
				Record{EventID: "v" + id, Kind: kindReserved, Tenant: "t", User: "u", RequestID: id, Tokens: 100, OccurredAt: at, Payload: []byte(`{}`)},
				Record{EventID: "a" + id, Kind: kindActual, Tenant: "t", User: "u", RequestID: id, Tokens: 40, OccurredAt: at, Payload: []byte(`{}`)})
		}
		return recs
	}
	// The plans are made at the first writes, on a table of one key, analyzed:
	// a sequential scan is then the cheapest way to read it. The first
	// write inserts its rows (their keys are new), the same batch again
	// finds them (its redelivery), which makes the upsert's plan.
	if _, err := pool.Exec(ctx, `INSERT INTO reservation_keys VALUES ('x', 'x', 'x', current_date); ANALYZE reservation_keys`); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if _, err := s.Write(ctx, batch(0)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := pool.Exec(ctx, `INSERT INTO reservation_keys (tenant, user_id, request_id, day)
		SELECT 't', 'u', 'bulk' || i, current_date FROM generate_series(1, 20000) i`); err != nil {
		t.Fatal(err)
	}
	plans()
	res, err := s.Write(ctx, batch(10)) // 10 requests written before, 10 new
	if err != nil || len(res.Reservations) != 20 {
		t.Fatalf("Write = %d reservations, %v; want 20", len(res.Reservations), err)
	}
	var upsert string
	noticed := plans()
	for _, p := range noticed {
		if _, plan, ok := strings.Cut(p, "\nInsert on reservations"); ok && strings.Contains(plan, "Conflict Resolution") {
			upsert = plan
		}
	}
	if upsert == "" {
		t.Fatalf("no plan of the reservations' write among %d notices", len(noticed))
	}
	// One probe of the index per event, by the event's values (not the
	// whole index read once, then joined).
	if !strings.Contains(upsert, "Index Scan using reservation_keys_pkey on reservation_keys k") ||
		!strings.Contains(upsert, "Index Cond: ((tenant = t.tenant) AND (user_id = t.user_id) AND (request_id = t.request_id))") {
		t.Errorf("the reservations' write reads reservation_keys without its index:\n%s", upsert)
	}
}

// TestUncreditedTopUps: a top-up first stored before the last rebuild and
// recorded after it is one Redis lost uncounted, at its first write as at
// its redeliveries; neither one recorded before the rebuild (which counted
// it) nor one first stored after it is.
func TestUncreditedTopUps(t *testing.T) {
	s := New(testPool(t))
	ctx := context.Background()
	topUp := func(id string, at time.Time) Record {
		return Record{EventID: id, Kind: kindTopUp, Tenant: "t", User: "u", RequestID: "ref-" + id, Tokens: 500, OccurredAt: at, Payload: []byte(`{}`)}
	}
	before := time.Now().Add(-time.Minute)
	write := func(recs ...Record) map[EventKey]bool {
		t.Helper()
		res, err := s.Write(ctx, recs)
		if err != nil {
			t.Fatal(err)
		}
		return res.Uncredited
	}
	if got := write(topUp("counted", before)); len(got) != 0 {
		t.Errorf("uncredited before any rebuild = %v, want none", got)
	}
	if err := s.MarkRebuild(ctx, "1"); err != nil {
		t.Fatal(err)
	}
	want := map[EventKey]bool{{Tenant: "t", EventID: "lost"}: true}
	for i := range 2 {
		got := write(topUp("counted", before), topUp("lost", before), topUp("later", time.Now().Add(time.Minute)))
		if !maps.Equal(got, want) {
			t.Errorf("write %d: uncredited = %v, want %v", i+1, got, want)
		}
	}
}
