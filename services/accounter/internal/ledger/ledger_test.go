package ledger

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"quotaflow/internal/pgtest"

	"github.com/jackc/pgx/v5/pgxpool"
)

// testPool creates a database of the test's own on the development
// Postgres (QF_POSTGRES_URL overrides it), migrates it and drops it at the
// end.
func testPool(t testing.TB) *pgxpool.Pool {
	pool := pgtest.Pool(t, "qf_ledger_test", Migrate)
	if err := Migrate(context.Background(), pool); err != nil {
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
		OccurredAt: at, Payload: []byte(`{}`), Plan: "pro", Endpoint: "/gen", ExpiresAt: at.Add(time.Hour)}

	// The actual first, twice in one batch (one event under two message ids).
	res, err := s.Write(ctx, []Record{actual, actual})
	if err != nil {
		t.Fatal(err)
	}
	k := Key{Tenant: "t", User: "u", RequestID: "r1"}
	if got := res.Reservations[k]; res.Inserted != 1 || got.Estimate != -1 || got.Actual != 40 || got.Status != StatusOpen {
		t.Fatalf("Write(actual, actual) = %d inserted, row %+v; want 1, no estimate, actual 40, open", res.Inserted, got)
	}
	// Then the reserved event, with the actual redelivered beside it.
	res, err = s.Write(ctx, []Record{reserved, actual})
	if err != nil {
		t.Fatal(err)
	}
	got := res.Reservations[k]
	if res.Inserted != 1 || got.Estimate != 100 || got.Actual != 40 || got.Plan != "pro" || got.Endpoint != "/gen" || !got.ReservedAt.Equal(at) {
		t.Fatalf("Write(reserved, actual) = %d inserted, row %+v; want 1, estimate 100, actual 40, plan pro, /gen, reserved at %v", res.Inserted, got, at)
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

func TestExpire(t *testing.T) {
	pool := testPool(t)
	s := New(pool)
	ctx := context.Background()
	now := time.Now()
	recs := []Record{
		{EventID: "old", Kind: kindReserved, Tenant: "t", User: "u", RequestID: "old", Tokens: 10, OccurredAt: now.Add(-2 * time.Hour), Payload: []byte(`{}`)},
		{EventID: "new", Kind: kindReserved, Tenant: "t", User: "u", RequestID: "new", Tokens: 10, OccurredAt: now, Payload: []byte(`{}`)},
		{EventID: "done-r", Kind: kindReserved, Tenant: "t", User: "u", RequestID: "done", Tokens: 10, OccurredAt: now.Add(-2 * time.Hour), Payload: []byte(`{}`)},
		{EventID: "done-a", Kind: kindActual, Tenant: "t", User: "u", RequestID: "done", Tokens: 5, OccurredAt: now.Add(-2 * time.Hour), Payload: []byte(`{}`)},
	}
	if _, err := s.Write(ctx, recs); err != nil {
		t.Fatal(err)
	}
	rows, err := s.Expired(ctx, now.Add(-time.Hour), 10)
	if err != nil || len(rows) != 1 || rows[0].RequestID != "old" {
		t.Fatalf("Expired = %+v, %v; want the old reservation only", rows, err)
	}
	n, err := s.ExpireAtEstimate(ctx, now.Add(-time.Hour))
	if err != nil || n != 1 {
		t.Fatalf("ExpireAtEstimate = %d, %v; want 1", n, err)
	}
	if n, _ := s.ExpireAtEstimate(ctx, now.Add(-time.Hour)); n != 0 {
		t.Errorf("ExpireAtEstimate again = %d, want 0", n)
	}

	// A reservation decided without Redis is left to the caller, which
	// charges its estimate: Expired says it is local.
	local := Record{EventID: "local", Kind: kindReserved, Tenant: "t", User: "u", RequestID: "local", Tokens: 10,
		OccurredAt: now.Add(-2 * time.Hour), Payload: []byte(`{}`), Local: true}
	if _, err := s.Write(ctx, []Record{local}); err != nil {
		t.Fatal(err)
	}
	if n, _ := s.ExpireAtEstimate(ctx, now.Add(-time.Hour)); n != 0 {
		t.Errorf("ExpireAtEstimate of a local reservation = %d, want 0", n)
	}
	rows, err = s.Expired(ctx, now.Add(-time.Hour), 10)
	if err != nil || len(rows) != 1 || rows[0].RequestID != "local" || !rows[0].Local {
		t.Errorf("Expired = %+v, %v; want the local reservation, marked local", rows, err)
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
	if err != nil || tx.Result.Inserted != 1 || tx.Result.Reservations[k].Status != StatusOpen {
		t.Fatalf("Begin = %+v, %v; want 1 inserted, open", tx, err)
	}
	tx.Rollback(ctx)
	if n := count("SELECT count(*) FROM usage_events") + count("SELECT count(*) FROM reservations"); n != 0 {
		t.Fatalf("%d rows after Rollback, want 0", n)
	}

	tx, err = s.Begin(ctx, recs)
	if err != nil || tx.Result.Inserted != 1 {
		t.Fatalf("Begin again = %+v, %v; want 1 inserted", tx, err)
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
