package ledger

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"quotaflow/internal/e2e"
)

// partitionedPool is a migrated test database with daily partitions up to
// AheadDays after today, and the first partitioned day after the first
// partition (which ends tomorrow): D, whose midnight with D+1 the tests
// cross.
func partitionedPool(t *testing.T) (*pgxpool.Pool, time.Time) {
	t.Helper()
	pool := testPool(t)
	if _, err := New(pool).EnsurePartitions(context.Background(), time.Now(), 1); err != nil {
		t.Fatal(err)
	}
	return pool, Day(time.Now()).AddDate(0, 0, 1)
}

// storeAt is a Store whose rows are written on the day of at.
func storeAt(pool *pgxpool.Pool, at time.Time) *Store {
	s := New(pool)
	s.now = func() time.Time { return at }
	return s
}

// settle writes recs as the consumer does: Redis corrects every
// reservation the write found open with an actual (it is told so by
// Reservation.Status), the commit marks them settled. It returns the keys
// corrected.
func settle(ctx context.Context, s *Store, recs []Record) ([]Key, error) {
	tx, err := s.Begin(ctx, recs)
	if err != nil {
		return nil, err
	}
	var corrected []Key
	var marks []Mark
	for k, r := range tx.Result.Reservations {
		if r.Status == StatusOpen && r.Actual >= 0 {
			corrected = append(corrected, k)
			marks = append(marks, Mark{Key: k, Status: StatusSettled})
		}
	}
	return corrected, tx.Commit(ctx, marks)
}

// TestRequestAcrossMidnight: a request whose reserved event is written at
// 23:59:59.9 of day D and its actual at 00:00:00.1 of D+1 (each event's
// time and the day it is written alike), in both orders, then both
// redelivered on D+2, is one row, in the partition of the day its first
// event was written, and one correction.
func TestRequestAcrossMidnight(t *testing.T) {
	pool, d := partitionedPool(t)
	ctx := context.Background()
	late := d.Add(24*time.Hour - 100*time.Millisecond)
	early := d.Add(24*time.Hour + 100*time.Millisecond)
	for _, order := range []string{"reserved first", "actual first"} {
		t.Run(order, func(t *testing.T) {
			req := "r-" + order
			reserved := Record{EventID: "v-" + req, Kind: kindReserved, Tenant: "t", User: "u", RequestID: req, Tokens: 100,
				OccurredAt: late, Plan: "pro", Endpoint: "/gen"}
			actual := Record{EventID: "a-" + req, Kind: kindActual, Tenant: "t", User: "u", RequestID: req, Tokens: 40,
				OccurredAt: early, Payload: []byte(`{"id":"a"}`)}
			first, second := reserved, actual
			firstDay := d
			if order == "actual first" {
				first, second = actual, reserved
				firstDay = d.AddDate(0, 0, 1)
			}
			var corrections int
			for _, w := range []struct {
				at   time.Time
				recs []Record
			}{
				{first.OccurredAt, []Record{first}},
				{second.OccurredAt, []Record{second}},
				{d.AddDate(0, 0, 2), []Record{second, first}},
				{d.AddDate(0, 0, 2), []Record{first}},
			} {
				c, err := settle(ctx, storeAt(pool, w.at), w.recs)
				if err != nil {
					t.Fatal(err)
				}
				corrections += len(c)
			}
			if corrections != 1 {
				t.Errorf("corrections = %d, want 1", corrections)
			}
			var rows int
			var day time.Time
			var est, act int64
			var status string
			if err := pool.QueryRow(ctx, `SELECT count(*) OVER (), day, estimated_tokens, actual_tokens, status
				FROM reservations WHERE request_id = $1`, req).Scan(&rows, &day, &est, &act, &status); err != nil {
				t.Fatal(err)
			}
			if rows != 1 || !day.Equal(firstDay) || est != 100 || act != 40 || status != StatusSettled {
				t.Errorf("rows = %d, day %v, estimate %d, actual %d, %s; want 1 row on %v, 100, 40, settled",
					rows, day, est, act, status, firstDay)
			}
		})
	}
}

// TestConcurrentWritersAcrossMidnight: two ledger writers, one writing on
// day D and one on D+1, each given every request's events in its own
// random order and batches, at once: every request has one row holding
// its estimate and its actual, and was corrected once.
func TestConcurrentWritersAcrossMidnight(t *testing.T) {
	pool, d := partitionedPool(t)
	ctx := context.Background()
	const n = 300
	var recs []Record
	for i := range n {
		req := fmt.Sprintf("r%03d", i)
		at := d.Add(24*time.Hour - 100*time.Millisecond)
		recs = append(recs,
			Record{EventID: "v" + req, Kind: kindReserved, Tenant: "t", User: fmt.Sprint("u", i%7), RequestID: req, Tokens: 100, OccurredAt: at},
			Record{EventID: "a" + req, Kind: kindActual, Tenant: "t", User: fmt.Sprint("u", i%7), RequestID: req, Tokens: int64(i), OccurredAt: at.Add(200 * time.Millisecond), Payload: []byte(`{}`)})
	}
	var mu sync.Mutex
	corrected := map[Key]int{}
	var wg sync.WaitGroup
	for w, day := range []time.Time{d, d.AddDate(0, 0, 1)} {
		s := storeAt(pool, day.Add(12*time.Hour))
		mine := slices.Clone(recs)
		rnd := rand.New(rand.NewPCG(uint64(w), 7))
		rnd.Shuffle(len(mine), func(i, j int) { mine[i], mine[j] = mine[j], mine[i] })
		wg.Go(func() {
			for len(mine) > 0 {
				b := min(len(mine), 1+rnd.IntN(40))
				keys, err := settle(ctx, s, mine[:b])
				if err != nil {
					t.Error(err)
					return
				}
				mine = mine[b:]
				mu.Lock()
				for _, k := range keys {
					corrected[k]++
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	var rows, keys, whole, days int
	if err := pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT (tenant, user_id, request_id)),
		count(*) FILTER (WHERE estimated_tokens = 100 AND actual_tokens IS NOT NULL AND status = 'settled'), count(DISTINCT day)
		FROM reservations`).Scan(&rows, &keys, &whole, &days); err != nil {
		t.Fatal(err)
	}
	if rows != n || keys != n || whole != n {
		t.Errorf("%d rows of %d requests, %d with estimate, actual and settled; want %d each", rows, keys, whole, n)
	}
	if days != 2 {
		t.Logf("rows on %d days (the race decides; 2 is usual)", days)
	}
	for k, c := range corrected {
		if c != 1 {
			t.Errorf("%v corrected %d times", k, c)
		}
	}
	if len(corrected) != n {
		t.Errorf("%d requests corrected, want %d", len(corrected), n)
	}
}

// TestTopUpReplayCreditsOnce: a top-up's id replayed with another time, on
// another day, is not stored again; after the retention dropped the
// top-up's partition its credit stays in the balance, and a replay still
// credits nothing.
func TestTopUpReplayCreditsOnce(t *testing.T) {
	pool, d := partitionedPool(t)
	ctx := context.Background()
	topup := func(at time.Time) Record {
		return Record{EventID: "pay-1", Kind: "quotaflow.balance.topup", Tenant: "t", User: "u", RequestID: "order-1",
			Tokens: 500, OccurredAt: at, Payload: []byte(`{"id":"pay-1"}`)}
	}
	spend := Record{EventID: "a1", Kind: kindActual, Tenant: "t", User: "u", RequestID: "r1", Tokens: 30, OccurredAt: d, Payload: []byte(`{}`)}
	write := func(at time.Time, recs ...Record) int {
		t.Helper()
		res, err := storeAt(pool, at).Write(ctx, recs)
		if err != nil {
			t.Fatal(err)
		}
		return res.Inserted
	}
	balance := func() (credited, spent int64) {
		t.Helper()
		var bs []Balance
		if err := New(pool).Balances(ctx, func(b Balance) error { bs = append(bs, b); return nil }); err != nil {
			t.Fatal(err)
		}
		if len(bs) != 1 {
			t.Fatalf("balances = %+v, want one", bs)
		}
		return bs[0].Credited, bs[0].Spent[""]
	}
	if n := write(d, topup(d), spend); n != 1 {
		t.Fatalf("top-up inserted %d rows, want 1", n)
	}
	if err := New(pool).MarkSettled(ctx, []Mark{{Key: Key{"t", "u", "r1"}, Status: StatusSettled}}); err != nil {
		t.Fatal(err)
	}
	if n := write(d.AddDate(0, 0, 2), topup(d.Add(time.Hour))); n != 0 {
		t.Errorf("replayed top-up inserted %d rows, want 0", n)
	}
	if c, s := balance(); c != 500 || s != 30 {
		t.Fatalf("balance = %d credited, %d spent; want 500, 30", c, s)
	}

	// Drop D's partitions (and the first): the balance is carried.
	now := d.AddDate(0, 0, 1).Add(40 * 24 * time.Hour)
	dropped, err := New(pool).DropPartitions(ctx, now, 40*24*time.Hour, 33*24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if len(dropped) != 4 {
		t.Errorf("dropped %v, want the first and D's of both tables", dropped)
	}
	if c, s := balance(); c != 500 || s != 30 {
		t.Errorf("balance after the retention = %d credited, %d spent; want 500, 30", c, s)
	}
	if n := write(d.AddDate(0, 0, 2), topup(d.Add(2*time.Hour))); n != 0 {
		t.Errorf("top-up replayed after its partition was dropped inserted %d rows, want 0", n)
	}
	if c, _ := balance(); c != 500 {
		t.Errorf("credited after the replay = %d, want 500", c)
	}
}

// TestBalancesSpentByPlan: a balance's spent comes by the plan of the
// reservations that spent it (empty for an actual alone), as the rows kept
// and as balance_carry keeps it after their partition was dropped, so the
// rebuild can count only the plans that hold the balance.
func TestBalancesSpentByPlan(t *testing.T) {
	pool, d := partitionedPool(t)
	ctx := context.Background()
	if _, err := storeAt(pool, d).Write(ctx, []Record{
		{EventID: "pay-u", Kind: "quotaflow.balance.topup", Tenant: "t", User: "u", RequestID: "o1", Tokens: 1000, OccurredAt: d, Payload: []byte(`{}`)},
		{EventID: "pay-v", Kind: "quotaflow.balance.topup", Tenant: "t", User: "v", RequestID: "o2", Tokens: 500, OccurredAt: d, Payload: []byte(`{}`)},
		{EventID: "v1", Kind: kindReserved, Tenant: "t", User: "u", RequestID: "r1", Plan: "prepaid", Tokens: 300, OccurredAt: d},
		{EventID: "v2", Kind: kindReserved, Tenant: "t", User: "u", RequestID: "r2", Plan: "free", Tokens: 5000, OccurredAt: d},
		{EventID: "a3", Kind: kindActual, Tenant: "t", User: "u", RequestID: "r3", Tokens: 40, OccurredAt: d, Payload: []byte(`{}`)},
	}); err != nil {
		t.Fatal(err)
	}
	if err := New(pool).MarkSettled(ctx, []Mark{{Key: Key{"t", "u", "r3"}, Status: StatusSettled}}); err != nil {
		t.Fatal(err)
	}
	want := []Balance{
		{Tenant: "t", User: "u", Credited: 1000, Spent: map[string]int64{"prepaid": 300, "free": 5000, "": 40}},
		{Tenant: "t", User: "v", Credited: 500, Spent: map[string]int64{}},
	}
	check := func(when string) {
		t.Helper()
		var bs []Balance
		if err := New(pool).Balances(ctx, func(b Balance) error { bs = append(bs, b); return nil }); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(bs, want) {
			t.Errorf("balances %s = %+v, want %+v", when, bs, want)
		}
	}
	check("kept")
	now := d.AddDate(0, 0, 1).Add(40 * 24 * time.Hour)
	if _, err := New(pool).DropPartitions(ctx, now, 40*24*time.Hour, 33*24*time.Hour); err != nil {
		t.Fatal(err)
	}
	check("carried")
}

// TestRetention drops the partitions whose days all lie beyond the
// retention, never one holding a day inside it, prunes their dedup rows
// (but top-up ids), and refuses a retention shorter than its floor.
func TestRetention(t *testing.T) {
	pool, d := partitionedPool(t)
	ctx := context.Background()
	for i := range 3 { // a request written on each of D, D+1 and D+2
		day := d.AddDate(0, 0, i)
		req := fmt.Sprint("r", i)
		if _, err := storeAt(pool, day).Write(ctx, []Record{
			{EventID: "v" + req, Kind: kindReserved, Tenant: "t", User: "u", RequestID: req, Tokens: 10, OccurredAt: day},
			{EventID: "x" + req, Kind: kindReleased, Tenant: "t", User: "u", RequestID: req, OccurredAt: day, Payload: []byte(`{}`)},
		}); err != nil {
			t.Fatal(err)
		}
	}
	count := func(q string) (n int) {
		t.Helper()
		if err := pool.QueryRow(ctx, q).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	const floor = 33 * 24 * time.Hour
	s := New(pool)
	// A second before D+2 is a floor old: D+1's rows may be younger than
	// the floor, so nothing of D+1 goes; D's all are older.
	now := d.AddDate(0, 0, 2).Add(floor - time.Second)
	if _, err := s.DropPartitions(ctx, now, floor-time.Hour, floor); !errors.Is(err, ErrRetentionTooShort) {
		t.Errorf("DropPartitions under the floor = %v, want ErrRetentionTooShort", err)
	}
	if n := count(`SELECT count(*) FROM reservations`); n != 3 {
		t.Fatalf("%d rows after a refused retention, want 3", n)
	}
	dropped, err := s.DropPartitions(ctx, now, floor, floor)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, p := range dropped {
		names = append(names, p.Name)
		if p.To.After(Day(now.Add(-floor))) {
			t.Errorf("dropped %s (to %v) holds a day inside the retention", p.Name, p.To)
		}
	}
	slices.Sort(names)
	dn := d.Format("20060102")
	if want := []string{"reservations_" + dn, "reservations_first", "usage_events_" + dn, "usage_events_first"}; !slices.Equal(names, want) {
		t.Errorf("dropped %v, want %v", names, want)
	}
	for q, want := range map[string]int{
		`SELECT count(*) FROM reservations`:     2,
		`SELECT count(*) FROM reservation_keys`: 2,
		`SELECT count(*) FROM usage_events`:     2,
		`SELECT count(*) FROM event_ids`:        2,
	} {
		if n := count(q); n != want {
			t.Errorf("%s = %d, want %d", q, n, want)
		}
	}
	// A late event of a dropped request is a new row, on its own day.
	if _, err := storeAt(pool, d.AddDate(0, 0, 2)).Write(ctx, []Record{{EventID: "a0", Kind: kindActual, Tenant: "t", User: "u",
		RequestID: "r0", Tokens: 5, OccurredAt: now, Payload: []byte(`{}`)}}); err != nil {
		t.Fatal(err)
	}
	if n := count(`SELECT count(*) FROM reservations WHERE request_id = 'r0' AND estimated_tokens IS NULL AND actual_tokens = 5`); n != 1 {
		t.Errorf("the late actual of a dropped request made %d rows, want 1", n)
	}
	// Running it again drops nothing more.
	if again, err := s.DropPartitions(ctx, now, floor, floor); err != nil || len(again) != 0 {
		t.Errorf("DropPartitions again = %v, %v; want nothing", again, err)
	}
}

// TestEnsurePartitions creates contiguous partitions ahead, aligned to the
// width, and nothing when run again.
func TestEnsurePartitions(t *testing.T) {
	pool := testPool(t)
	ctx := context.Background()
	s := New(pool)
	now := time.Now()
	created, err := s.EnsurePartitions(ctx, now, 7)
	if err != nil {
		t.Fatal(err)
	}
	until := Day(now).AddDate(0, 0, AheadDays+1)
	for _, table := range Partitioned {
		parts, err := s.Partitions(ctx, table)
		if err != nil {
			t.Fatal(err)
		}
		slices.SortFunc(parts, func(a, b Partition) int { return a.To.Compare(b.To) })
		if !parts[0].From.IsZero() || !parts[len(parts)-1].To.After(until.Add(-time.Nanosecond)) {
			t.Errorf("%s: partitions %v do not reach %v", table, parts, until)
		}
		for i := 1; i < len(parts); i++ {
			if p := parts[i]; !p.From.Equal(parts[i-1].To) || p.To.Unix()/86400%7 != 0 || p.To.Sub(p.From) > 7*24*time.Hour {
				t.Errorf("%s: partition %+v after %+v: want contiguous, ending on a multiple of 7 days", table, p, parts[i-1])
			}
		}
	}
	if len(created) == 0 {
		t.Error("created no partition")
	}
	if again, err := s.EnsurePartitions(ctx, now, 7); err != nil || len(again) != 0 {
		t.Errorf("EnsurePartitions again = %v, %v; want nothing", again, err)
	}
}

// TestDropFoldsWriteCommittedBeforeIt: a batch holding a write to a
// partition past the retention (an actual of its request, as the consumer
// holds one open around Redis) commits while DropPartitions waits for it:
// the fold counts the write, spent 30 (without the partition's SHARE lock
// before the fold, the fold ran first and balance_carry kept the reserved
// 100).
func TestDropFoldsWriteCommittedBeforeIt(t *testing.T) {
	pool, d := partitionedPool(t)
	ctx := context.Background()
	if _, err := storeAt(pool, d).Write(ctx, []Record{
		{EventID: "pay", Kind: "quotaflow.balance.topup", Tenant: "t", User: "u", RequestID: "o", Tokens: 500, OccurredAt: d, Payload: []byte(`{}`)},
		{EventID: "v1", Kind: kindReserved, Tenant: "t", User: "u", RequestID: "r1", Tokens: 100, OccurredAt: d},
	}); err != nil {
		t.Fatal(err)
	}
	const retention, floor = 40 * 24 * time.Hour, 33 * 24 * time.Hour
	// The first partition alone, so that D's is the first one folded below.
	if _, err := New(pool).DropPartitions(ctx, d.AddDate(0, 0, 40), retention, floor); err != nil {
		t.Fatal(err)
	}
	now := d.AddDate(0, 0, 42)
	tx, err := storeAt(pool, now).Begin(ctx, []Record{{EventID: "a1", Kind: kindActual, Tenant: "t", User: "u", RequestID: "r1", Tokens: 30, OccurredAt: d, Payload: []byte(`{}`)}})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := New(pool).DropPartitions(ctx, now, retention, floor)
		done <- err
	}()
	e2e.Eventually(t, "the retention waiting for the batch's lock", func() bool {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND (query LIKE 'DROP TABLE%' OR query LIKE 'LOCK TABLE%')`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n > 0
	})
	if err := tx.Commit(ctx, []Mark{{Key: Key{"t", "u", "r1"}, Status: StatusSettled}}); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	var bs []Balance
	if err := New(pool).Balances(ctx, func(b Balance) error { bs = append(bs, b); return nil }); err != nil {
		t.Fatal(err)
	}
	if len(bs) != 1 || bs[0].Credited != 500 || bs[0].Spent[""] != 30 {
		t.Errorf("balances after the drop = %+v, want credited 500, spent 30", bs)
	}
}

// TestEnsurePartitionsBesideWriters: four writers of ordinary batches
// (reserved and released of today's requests) while EnsurePartitions runs
// 20 times, a day further each: no run fails and no batch does (with the
// partitions created reservations first, CREATE TABLE ... PARTITION OF
// locking each parent ACCESS EXCLUSIVE, batches aborted "deadlock
// detected" and runs failed).
func TestEnsurePartitionsBesideWriters(t *testing.T) {
	pool, _ := partitionedPool(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	now := time.Now()
	s := New(pool)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var writerErrs []error
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ctx.Err() == nil; i++ {
				req := fmt.Sprint("w", w, "-", i)
				_, err := settle(ctx, s, []Record{
					{EventID: "v" + req, Kind: kindReserved, Tenant: "t", User: "w", RequestID: req, Tokens: 10, OccurredAt: now},
					{EventID: "x" + req, Kind: kindReleased, Tenant: "t", User: "w", RequestID: req, OccurredAt: now, Payload: []byte(`{}`)},
				})
				if err != nil && ctx.Err() == nil {
					mu.Lock()
					writerErrs = append(writerErrs, err)
					mu.Unlock()
				}
			}
		}()
	}
	var runErrs []error
	for i := range 20 {
		if _, err := s.EnsurePartitions(ctx, now.AddDate(0, 0, 3+i), 1); err != nil {
			runErrs = append(runErrs, err)
			break // the days would no longer be contiguous
		}
	}
	cancel()
	wg.Wait()
	if len(runErrs) > 0 || len(writerErrs) > 0 {
		t.Errorf("EnsurePartitions failed %d times: %v; batches failed %d times: %v", len(runErrs), runErrs, len(writerErrs), writerErrs[:min(3, len(writerErrs))])
	}
}
