// Package ledger is the accounter's durable record in Postgres: every
// consumed event once (usage_events; a reserved or actual event is
// recorded in its reservation row alone), the durable copy of each
// reservation (reservations) and hourly usage totals (usage_rollups, a
// view of the reservations). Its
// migrations are embedded and applied at start under an advisory lock.
// Every write is idempotent, so a redelivered batch changes nothing.
package ledger

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"quotaflow/internal/pgdb"
)

//go:embed migrations/*.sql
var migrations embed.FS

// VersionTable records which migrations ran; it is the accounter's own, so
// other services may keep theirs in the same database.
const VersionTable = "accounter_schema_version"

// Migrate applies the accounter's embedded migrations that have not run
// yet (pgdb.Migrate: under an advisory lock, so instances starting together
// apply each once).
func Migrate(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger) error {
	return pgdb.Migrate(ctx, pool, migrations, VersionTable, log)
}

// Statuses of a reservation row; see migrations/001_ledger.sql.
const (
	StatusOpen            = "open"             // nothing settled in Redis yet
	StatusSettled         = "settled"          // the actual cost is applied in Redis
	StatusReleased        = "released"         // the estimate was given back in Redis
	StatusExpired         = "expired"          // no actual before the TTL: settled at the estimate
	StatusExpiredReleased = "expired_released" // no actual before the TTL: the estimate given back
)

// Key identifies a reservation: the Redis correction's idempotency key.
type Key struct {
	Tenant, User, RequestID string
}

// EventKey identifies an event in the ledger: ids are unique per tenant.
type EventKey struct {
	Tenant, EventID string
}

// Record is one consumed event as the ledger stores it (RequestID holds a
// top-up's reference and is empty for a denial). Kind is the
// CloudEvent type; Tokens the weighted cost (reserved: the estimate; actual:
// the actual cost; released and denied: 0; topup: the amount). Plan,
// Endpoint and Model feed the reservation row of reserved, actual and
// released events.
type Record struct {
	EventID    string
	Kind       string
	Tenant     string
	User       string
	RequestID  string
	Tokens     int64
	OccurredAt time.Time // the CloudEvent time
	// Payload is the event's JSON, stored with every event but a reserved
	// one, whose reservation row holds what the ledger keeps of it: an
	// actual's in its reservation row. It is stored as it is (bytea,
	// unparsed): the caller checked it.
	Payload  []byte
	Plan     string
	Endpoint string
	Model    string
	// Local marks a reserved event of a decision made without Redis
	// (version 0): no Redis window holds its estimate.
	Local bool
}

// Reservation is a reservations row after a write. Estimate is -1 when no
// reserved event has arrived; ReservedAt is zero then.
type Reservation struct {
	Key
	Plan       string
	Endpoint   string
	Estimate   int64
	Actual     int64 // -1 when no actual event has arrived
	ReservedAt time.Time
	// At is when the row's usage counts, in the windows as in a rebuild:
	// its reservation's time, else its first actual's, else its release's.
	At     time.Time
	Status string
	Local  bool // decided without Redis: no window holds the estimate
}

// Store reads and writes the ledger. It is safe for concurrent use; create
// it with New.
type Store struct {
	pool *pgxpool.Pool
	now  func() time.Time // the day of new rows; tests set it
}

// New returns a Store over pool (already migrated).
func New(pool *pgxpool.Pool) *Store { return &Store{pool: pool, now: time.Now} }

// Day is the partition day of a row written at t: its UTC date.
func Day(t time.Time) time.Time {
	y, m, d := t.UTC().Date()
	return time.Date(y, m, d, 0, 0, 0, 0, time.UTC)
}

// Kinds of reservation event, as the CloudEvent type strings.
const (
	kindReserved = "quotaflow.usage.reserved"
	kindActual   = "quotaflow.usage.actual"
	kindReleased = "quotaflow.usage.released"
	kindTopUp    = "quotaflow.balance.topup"
)

// insertEvents stores the events of a batch that are new, but reserved
// and actual ones: their reservation row is their record
// (upsertReservations), so the ledger writes one row per request, not
// three, and one index entry per index. A payload goes to the column event as bytes, which Postgres
// does not parse (jsonb's parse was most of an actual event's insert). The
// batch comes as one array per column (eventArgs), so that its write is one
// exchange with its BEGIN: no COPY into a staging table first.
//
// An event id is once per tenant across partitions: usage_events' own key
// holds the partition day ($9, today), so event_ids holds every stored id,
// and only the ids it takes are inserted. A concurrent batch with the same id waits
// on the id's insert and, once it committed, takes nothing.
const insertEvents = `
WITH e AS (
    SELECT DISTINCT ON (tenant, event_id) event_id, type, tenant, user_id, request_id, tokens, occurred_at, event
    FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bigint[], $7::timestamptz[], $8::bytea[])
        AS e(event_id, type, tenant, user_id, request_id, tokens, occurred_at, event)
    ORDER BY tenant, event_id
), ids AS (
    INSERT INTO event_ids (tenant, event_id, day, topup)
    SELECT tenant, event_id, $9::date, type = 'quotaflow.balance.topup' FROM e
    ON CONFLICT (tenant, event_id) DO NOTHING
    RETURNING tenant, event_id
)
INSERT INTO usage_events (event_id, type, tenant, user_id, request_id, tokens, occurred_at, event, day)
SELECT e.event_id, e.type, e.tenant, e.user_id, e.request_id, e.tokens, e.occurred_at, e.event, $9::date
FROM e JOIN ids USING (tenant, event_id)`

// selectUncredited finds which of the batch's top-ups ($1 tenants, $2
// event ids, stored by insertEvents before) Redis lost with its data
// uncounted: first stored (occurred_at) before the last rebuild's mark,
// recorded (received_at, its transaction's start) after it, so the rebuild,
// which reads the ledger after its mark and while no batch of its process
// writes, cannot have credited it, and the Redis that admission credited
// it in is gone. Its redeliveries are found again, until Redis took it.
const selectUncredited = `
SELECT u.tenant, u.event_id
FROM unnest($1::text[], $2::text[]) AS t(tenant, event_id)
JOIN event_ids i USING (tenant, event_id)
JOIN usage_events u ON u.tenant = i.tenant AND u.event_id = i.event_id AND u.day = i.day
CROSS JOIN (SELECT max(at) AS at FROM rebuilds) b
WHERE u.type = 'quotaflow.balance.topup' AND u.occurred_at < b.at AND u.received_at > b.at`

// insertKeys gives each request of the batch that has none a key in
// reservation_keys, on day $4 (today, UTC): its row's partition, and
// returns the keys it inserted. Keys are inserted in key order, as rows
// are locked, so concurrent batches cannot deadlock; a batch that meets
// another's new key waits for its commit.
const insertKeys = `
INSERT INTO reservation_keys (tenant, user_id, request_id, day)
SELECT DISTINCT tenant, user_id, request_id, $4::date
FROM unnest($1::text[], $2::text[], $3::text[]) AS k(tenant, user_id, request_id)
ORDER BY tenant, user_id, request_id
ON CONFLICT (tenant, user_id, request_id) DO NOTHING
RETURNING tenant, user_id, request_id`

// upsertReservations merges the batch's reserved, actual and released
// events (reservationRecords: the first of each kind of a request) into their
// reservation rows (first value wins, so a redelivery changes nothing) and
// returns every touched row. An actual's cost and JSON (actual_event) are
// taken together, so the row records the actual Redis was corrected by:
// the first of its request, in the batch as across batches. A row is
// local when its estimate is in no Redis window: decided without Redis, or
// reserved in a Redis that lost its data before a rebuild counted it.
//
// An open row that the batch gives an actual is written settled at once,
// as the consumer will mark it once Redis took the correction, so that a
// request's actual and settlement make one row version, not two; the row
// keeps the status it had in prior_status, which is what the batch is told
// (Reservation.Status) and what Commit puts back if Redis did not take it.
// It writes the rows of the requests whose keys were there before the
// batch (insertReservations writes the others), locking in key order:
// concurrent batches cannot deadlock.
//
// The row lives in the partition of its key's day (reservation_keys, which
// insertKeys found before, in the statement ahead of this one, so that
// this statement's snapshot sees a key another batch committed
// meanwhile): a request has one row whichever of its events came first
// and on whichever day. Each event finds its key by one probe of the key
// index (the LATERAL, and write's setting): a join of the batch with the
// table, as Postgres may plan it, reads the whole table.
var upsertReservations = fmt.Sprintf(reservationRows, "k.day", `
    CROSS JOIN LATERAL (SELECT day FROM reservation_keys k
        WHERE k.tenant = t.tenant AND k.user_id = t.user_id AND k.request_id = t.request_id LIMIT 1) k`) + `
ON CONFLICT (tenant, user_id, request_id, day) DO UPDATE SET
    plan = CASE WHEN r.estimated_tokens IS NULL AND excluded.estimated_tokens IS NOT NULL THEN excluded.plan ELSE r.plan END,
    endpoint = CASE WHEN (r.estimated_tokens IS NULL AND excluded.estimated_tokens IS NOT NULL) OR r.endpoint = ''
        THEN excluded.endpoint ELSE r.endpoint END,
    model = CASE WHEN r.model = '' THEN excluded.model ELSE r.model END,
    -- the first reserved event of a request id decides, as for every
    -- other field: its id is the request's, and a later copy (stored again
    -- in another batch, with another snapshot) must not change the row
    local = CASE WHEN r.estimated_tokens IS NULL THEN excluded.local ELSE r.local END,
    estimated_tokens = coalesce(r.estimated_tokens, excluded.estimated_tokens),
    reserved_at = coalesce(r.reserved_at, excluded.reserved_at),
    actual_tokens = coalesce(r.actual_tokens, excluded.actual_tokens),
    actual_event = CASE WHEN r.actual_tokens IS NULL THEN excluded.actual_event ELSE r.actual_event END,
    actual_at = coalesce(r.actual_at, excluded.actual_at),
    released_at = coalesce(r.released_at, excluded.released_at),
    -- excluded.status is settled when the batch has an actual
    status = CASE WHEN r.status = 'open' THEN excluded.status ELSE r.status END,
    settled_at = CASE WHEN r.status = 'open' THEN excluded.settled_at ELSE r.settled_at END,
    prior_status = CASE WHEN r.status = 'open' THEN excluded.prior_status END` + reservationsReturning

// insertReservations writes the rows of the requests whose keys insertKeys
// inserted in this transaction, on their key's day ($12): none has a row
// yet, nor can another batch write one before this one commits (it would
// wait on the key), so a plain insert does, without an upsert's check of
// the key index first and its confirmation (an upsert inserting 200,000
// new rows took 60 % longer than an insert in psql) or the key's lookup.
var insertReservations = fmt.Sprintf(reservationRows, "$12::date", "") + reservationsReturning

// reservationRows is the insert of a batch's reservation rows, their day
// %[1]s, found by %[2]s: the events' fields merged per request, the first of
// each kind deciding (reservationRecords), in key order.
const reservationRows = `
INSERT INTO reservations AS r (tenant, user_id, request_id, day, plan, endpoint, model,
    estimated_tokens, reserved_at, actual_tokens, actual_event, actual_at, released_at, local,
    status, settled_at, prior_status)
SELECT tenant, user_id, request_id, %[1]s,
    coalesce(max(plan) FILTER (WHERE kind = 'quotaflow.usage.reserved'), ''),
    coalesce(max(endpoint) FILTER (WHERE kind = 'quotaflow.usage.reserved'), max(endpoint), ''),
    coalesce(max(model) FILTER (WHERE kind = 'quotaflow.usage.reserved'), max(model), ''),
    max(tokens) FILTER (WHERE kind = 'quotaflow.usage.reserved'),
    min(at) FILTER (WHERE kind = 'quotaflow.usage.reserved'),
    max(tokens) FILTER (WHERE kind = 'quotaflow.usage.actual'),
    (array_agg(event) FILTER (WHERE kind = 'quotaflow.usage.actual'))[1],
    min(at) FILTER (WHERE kind = 'quotaflow.usage.actual'),
    min(at) FILTER (WHERE kind = 'quotaflow.usage.released'),
    coalesce(bool_and(local) FILTER (WHERE kind = 'quotaflow.usage.reserved'), false)
        -- reserved before the last rebuild, known only after it: the Redis
        -- that held it lost its data, the rebuilt one never counted it
        OR coalesce(min(at) FILTER (WHERE kind = 'quotaflow.usage.reserved') < (SELECT max(at) FROM rebuilds), false),
    CASE WHEN bool_or(kind = 'quotaflow.usage.actual') THEN 'settled' ELSE 'open' END,
    CASE WHEN bool_or(kind = 'quotaflow.usage.actual') THEN now() END,
    CASE WHEN bool_or(kind = 'quotaflow.usage.actual') THEN 'open' END
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::bigint[],
    $9::timestamptz[], $10::boolean[], $11::bytea[])
    AS t(tenant, user_id, request_id, kind, plan, endpoint, model, tokens, at, local, event)%[2]s
GROUP BY tenant, user_id, request_id, %[1]s
ORDER BY tenant, user_id, request_id -- one lock order for concurrent batches`

// reservationsReturning is what both statements return of each row
// (readReservations).
const reservationsReturning = `
RETURNING tenant, user_id, request_id, plan, endpoint, coalesce(estimated_tokens, -1),
    coalesce(actual_tokens, -1), reserved_at, coalesce(reserved_at, actual_at, released_at),
    coalesce(prior_status, status), local, prior_status IS NOT NULL, day`

// WriteResult is what a write did.
type WriteResult struct {
	// Inserted is how many usage_events rows were new: the events but
	// reserved and actual ones (recorded in their reservation row) that
	// were not redeliveries.
	Inserted int
	// Reservations holds the row of every reservation the batch touched,
	// after the write.
	Reservations map[Key]Reservation
	// Uncredited holds the batch's top-ups that no Redis holds since it
	// lost its data and was rebuilt without them (selectUncredited): the
	// consumer credits them again, by their own reference, so once.
	Uncredited map[EventKey]bool
}

// Tx is a batch's write in progress: its events and reservation rows are
// written and locked, not yet committed. The consumer applies the batch's
// Redis effects meanwhile, so that Commit records them (marks) in the same
// transaction. The expiry's pages are Txs too (BeginExpired), which lock
// and write nothing but the rows of their marks. Call Commit or Rollback;
// Rollback after Commit does nothing.
//
// It drives the transaction on a pooled connection itself, rather than
// through pgx.Tx, so that BEGIN and COMMIT travel with other statements:
// up to three exchanges a batch (BEGIN with the events and the keys, the
// reservation rows, the settlements with COMMIT).
type Tx struct {
	conn *pgxpool.Conn // nil once committed or rolled back
	// Result is what the write did, as the transaction sees it.
	Result WriteResult
	// settled holds the rows the write settled ahead of the consumer's
	// marks (see upsertReservations).
	settled map[Key]bool
	// days holds the partition day of every row the write touched.
	days map[Key]time.Time
}

// Begin writes a batch in a new transaction and leaves it open: the new
// events are stored and the reservation rows merged (their rows returned
// in Result). A
// redelivered record changes nothing.
func (s *Store) Begin(ctx context.Context, recs []Record) (*Tx, error) {
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("ledger write of %d events: %w", len(recs), err)
	}
	t := &Tx{conn: conn, Result: WriteResult{Reservations: make(map[Key]Reservation, len(recs))}, settled: map[Key]bool{},
		days: make(map[Key]time.Time, len(recs))}
	if err := t.write(ctx, recs, Day(s.now())); err != nil {
		t.Rollback(ctx)
		return nil, fmt.Errorf("ledger write of %d events: %w", len(recs), err)
	}
	return t, nil
}

func (t *Tx) write(ctx context.Context, recs []Record, day time.Time) error {
	res := &t.Result
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	// A batch is small beside the tables it writes: its statements find
	// rows by their keys' indexes. A plan made while a table was small
	// (a prepared statement keeps it until the table is analyzed again)
	// would read the whole table per batch, or per event, as it grows.
	b.Queue("SET LOCAL enable_seqscan = off")
	if args, n := eventArgs(recs); n > 0 {
		b.Queue(insertEvents, append(args, day)...).Exec(func(ct pgconn.CommandTag) error {
			res.Inserted = int(ct.RowsAffected())
			return nil
		})
	}
	if tenants, ids := topUpArgs(recs); len(ids) > 0 {
		b.Queue(selectUncredited, tenants, ids).Query(func(rows pgx.Rows) error {
			var k EventKey
			_, err := pgx.ForEachRow(rows, []any{&k.Tenant, &k.EventID}, func() error {
				if res.Uncredited == nil {
					res.Uncredited = map[EventKey]bool{}
				}
				res.Uncredited[k] = true
				return nil
			})
			return err
		})
	}
	rs, keys := reservationRecords(recs)
	fresh := make(map[string]bool, keys) // packKey of each key insertKeys inserted
	if len(rs) > 0 {
		tenants, users, reqs := keyArgs(rs)
		b.Queue(insertKeys, tenants, users, reqs, day).Query(func(rows pgx.Rows) error {
			for rows.Next() {
				v := rows.RawValues()
				fresh[string(packKey(nil, v[0], v[1], v[2]))] = true
			}
			return rows.Err()
		})
	}
	if err := t.conn.SendBatch(ctx, b).Close(); err != nil {
		return err
	}
	if len(rs) == 0 {
		return nil
	}
	// The rows of the keys just inserted, then the others': in a second
	// exchange, since which keys are new is known only now.
	var newRows, oldRows []*Record
	var key []byte
	for _, r := range rs {
		if key = packKey(key[:0], r.Tenant, r.User, r.RequestID); fresh[string(key)] {
			newRows = append(newRows, r)
		} else {
			oldRows = append(oldRows, r)
		}
	}
	b = &pgx.Batch{}
	if len(newRows) > 0 {
		b.Queue(insertReservations, append(rowArgs(newRows), day)...).Query(t.readReservations)
	}
	if len(oldRows) > 0 {
		b.Queue(upsertReservations, rowArgs(oldRows)...).Query(t.readReservations)
	}
	if err := t.conn.SendBatch(ctx, b).Close(); err != nil {
		return err
	}
	if len(res.Reservations) != keys {
		// A key the retention deleted between the two statements, with
		// its partition: the batch's next try gives the request a new one.
		return fmt.Errorf("%w: %d of %d reservations written", ErrKeyGone, len(res.Reservations), keys)
	}
	return nil
}

// ErrKeyGone is returned by Begin when a request's key was pruned by the
// retention while the batch wrote: writing the batch again succeeds.
var ErrKeyGone = errors.New("a reservation's key was pruned during the write")

// readReservations reads insertReservations' or upsertReservations' rows
// into the Result.
func (t *Tx) readReservations(rows pgx.Rows) error {
	res := &t.Result
	var v Reservation
	var reservedAt *time.Time
	var settled bool
	var day time.Time
	_, err := pgx.ForEachRow(rows, []any{&v.Tenant, &v.User, &v.RequestID, &v.Plan, &v.Endpoint, &v.Estimate, &v.Actual, &reservedAt, &v.At, &v.Status, &v.Local, &settled, &day}, func() error {
		v.ReservedAt = time.Time{}
		if reservedAt != nil {
			v.ReservedAt = *reservedAt
		}
		res.Reservations[v.Key] = v
		t.days[v.Key] = day
		if settled {
			t.settled[v.Key] = true
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("write reservations: %w", err)
	}
	return nil
}

// eventArgs are insertEvents' arguments: the records but reserved and
// actual ones, one array per column, and how many they are.
func eventArgs(recs []Record) ([]any, int) {
	var (
		ids, kinds, tenants, users, reqs []string
		payloads                         [][]byte
		tokens                           []int64
		at                               []time.Time
	)
	for i := range recs {
		r := &recs[i]
		if r.Kind == kindReserved || r.Kind == kindActual {
			continue
		}
		ids, kinds, tenants, users, reqs = append(ids, r.EventID), append(kinds, r.Kind), append(tenants, r.Tenant), append(users, r.User), append(reqs, r.RequestID)
		tokens, at, payloads = append(tokens, r.Tokens), append(at, r.OccurredAt), append(payloads, r.Payload)
	}
	return []any{ids, kinds, tenants, users, reqs, tokens, at, payloads}, len(ids)
}

// topUpArgs are selectUncredited's arguments: the tenants and event ids of
// recs' top-ups.
func topUpArgs(recs []Record) (tenants, ids []string) {
	for i := range recs {
		if r := &recs[i]; r.Kind == kindTopUp {
			tenants, ids = append(tenants, r.Tenant), append(ids, r.EventID)
		}
	}
	return tenants, ids
}

// reservationRecords are the records of the batch's reservation rows: the
// first reserved, actual and released record of each request, and how many
// requests. Later ones of a kind are left out as the consumer's effects
// leave them (one per request and kind): the row must record what Redis
// applied.
func reservationRecords(recs []Record) ([]*Record, int) {
	type kindKey struct {
		Key
		kind string
	}
	var out []*Record
	seen := make(map[kindKey]bool, len(recs))
	keys := make(map[Key]bool, len(recs))
	for i := range recs {
		r := &recs[i]
		if r.Kind != kindReserved && r.Kind != kindActual && r.Kind != kindReleased {
			continue
		}
		k := kindKey{Key{r.Tenant, r.User, r.RequestID}, r.Kind}
		if seen[k] {
			continue
		}
		seen[k], keys[k.Key] = true, true
		out = append(out, r)
	}
	return out, len(keys)
}

// keyArgs are insertKeys' arrays of rs's keys (repeats allowed).
func keyArgs(rs []*Record) (tenants, users, reqs []string) {
	tenants, users, reqs = make([]string, len(rs)), make([]string, len(rs)), make([]string, len(rs))
	for i, r := range rs {
		tenants[i], users[i], reqs[i] = r.Tenant, r.User, r.RequestID
	}
	return tenants, users, reqs
}

// rowArgs are insertReservations' and upsertReservations' arguments for
// rs: one array per column, an actual's JSON beside it (nil for the
// others).
func rowArgs(rs []*Record) []any {
	n := len(rs)
	tenants, users, reqs := keyArgs(rs)
	kinds, plans, endpoints, models := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	tokens, at, local, payloads := make([]int64, n), make([]time.Time, n), make([]bool, n), make([][]byte, n)
	for i, r := range rs {
		kinds[i], plans[i], endpoints[i], models[i] = r.Kind, r.Plan, r.Endpoint, r.Model
		tokens[i], at[i], local[i] = r.Tokens, r.OccurredAt, r.Local
		if r.Kind == kindActual {
			payloads[i] = r.Payload
		}
	}
	return []any{tenants, users, reqs, kinds, plans, endpoints, models, tokens, at, local, payloads}
}

// packKey appends a request's key to dst as one string's bytes: its parts
// joined by NUL, which text never holds.
func packKey[T string | []byte](dst []byte, tenant, user, requestID T) []byte {
	dst = append(append(dst, tenant...), 0)
	dst = append(append(dst, user...), 0)
	return append(dst, requestID...)
}

// Commit records marks (see MarkSettled) and commits, in one round trip.
// A row the write settled ahead (upsertReservations) is left as it is when
// marks settle it, and else set to its mark's status, or back to open
// without a mark: Redis did not take its correction.
func (t *Tx) Commit(ctx context.Context, marks []Mark) error {
	var rest, undo []Mark
	marked := make(map[Key]bool, len(t.settled))
	for _, m := range marks {
		switch {
		case !t.settled[m.Key]:
			rest = append(rest, m)
		case m.Status != StatusSettled:
			undo = append(undo, m)
		}
		marked[m.Key] = true
	}
	for k := range t.settled {
		if !marked[k] {
			undo = append(undo, Mark{Key: k, Status: StatusOpen})
		}
	}
	b := &pgx.Batch{}
	queueMarks(b, markSettled, rest, t.days)
	queueMarks(b, undoSettled, undo, t.days)
	b.Queue("COMMIT")
	if err := t.conn.SendBatch(ctx, b).Close(); err != nil {
		t.Rollback(ctx)
		return fmt.Errorf("ledger commit: %w", err)
	}
	t.conn.Release()
	t.conn = nil
	return nil
}

// Rollback abandons the write.
func (t *Tx) Rollback(ctx context.Context) {
	if t.conn == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if _, err := t.conn.Exec(ctx, "ROLLBACK"); err != nil {
		// The connection's state is unknown: it must not go back to the pool.
		_ = t.conn.Conn().Close(ctx)
	}
	t.conn.Release()
	t.conn = nil
}

// Write stores a batch in one transaction (Begin, then Commit without
// marks). Writing the same records again changes nothing.
func (s *Store) Write(ctx context.Context, recs []Record) (WriteResult, error) {
	t, err := s.Begin(ctx, recs)
	if err != nil {
		return WriteResult{}, err
	}
	return t.Result, t.Commit(ctx, nil)
}

// Mark records that Redis now holds the effect of a reservation's actual or
// release event (Status is StatusSettled or StatusReleased), or of its
// expiry (StatusExpired or StatusExpiredReleased).
type Mark struct {
	Key
	Status string
}

// markSettled moves open rows to their settled status, and released ones
// to settled (actual usage always wins over a release); other rows keep
// theirs. A key appears once in the marks (see Tx.Commit). It updates the
// rows of one partition day, $5, so that Postgres plans and locks that
// partition alone, not every partition of the retention (queueMarks).
const markSettled = `
UPDATE reservations AS r SET status = m.status, settled_at = now()
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) AS m(tenant, user_id, request_id, status)
WHERE r.day = $5::date AND r.tenant = m.tenant AND r.user_id = m.user_id AND r.request_id = m.request_id
    AND (r.status = 'open' OR (r.status = 'released' AND m.status = 'settled'))`

// undoSettled sets rows the batch's write settled ahead to the status
// the consumer found for them: open (Redis did not take the correction) or
// released. The batch holds their locks since its write.
const undoSettled = `
UPDATE reservations AS r SET status = m.status, prior_status = NULL,
    settled_at = CASE WHEN m.status = 'open' THEN NULL ELSE r.settled_at END
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) AS m(tenant, user_id, request_id, status)
WHERE r.day = $5::date AND r.tenant = m.tenant AND r.user_id = m.user_id AND r.request_id = m.request_id`

// selectDays reads the partition day of each key.
const selectDays = `
SELECT k.tenant, k.user_id, k.request_id, k.day
FROM unnest($1::text[], $2::text[], $3::text[]) AS m(tenant, user_id, request_id)
    JOIN reservation_keys k USING (tenant, user_id, request_id)`

// MarkSettled records marks, in one statement per partition day of their
// rows, in one transaction. Calling it again changes nothing.
func (s *Store) MarkSettled(ctx context.Context, marks []Mark) error {
	if len(marks) == 0 {
		return nil
	}
	args := markArgs(marks)
	rows, err := s.pool.Query(ctx, selectDays, args[:3]...)
	if err != nil {
		return fmt.Errorf("mark %d reservations settled: %w", len(marks), err)
	}
	days := make(map[Key]time.Time, len(marks))
	var k Key
	var day time.Time
	if _, err := pgx.ForEachRow(rows, []any{&k.Tenant, &k.User, &k.RequestID, &day}, func() error {
		days[k] = day
		return nil
	}); err != nil {
		return fmt.Errorf("mark %d reservations settled: %w", len(marks), err)
	}
	b := &pgx.Batch{}
	queueMarks(b, markSettled, marks, days)
	if err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error { return tx.SendBatch(ctx, b).Close() }); err != nil {
		return fmt.Errorf("mark %d reservations settled: %w", len(marks), err)
	}
	return nil
}

// queueMarks queues query (markSettled or undoSettled) once for each
// partition day of the marks' rows (days; a mark of no row is left out:
// there is nothing to mark).
func queueMarks(b *pgx.Batch, query string, marks []Mark, days map[Key]time.Time) {
	byDay := map[time.Time][]Mark{}
	for _, m := range marks {
		if d, ok := days[m.Key]; ok {
			byDay[d] = append(byDay[d], m)
		}
	}
	// In day order, as every batch locks rows, so that two cannot deadlock.
	for _, d := range slices.SortedFunc(maps.Keys(byDay), time.Time.Compare) {
		b.Queue(query, append(markArgs(byDay[d]), d)...)
	}
}

// markArgs are markSettled's arguments for marks, but the day.
func markArgs(marks []Mark) []any {
	t, u, r, st := make([]string, len(marks)), make([]string, len(marks)), make([]string, len(marks)), make([]string, len(marks))
	for i, m := range marks {
		t[i], u[i], r[i], st[i] = m.Tenant, m.User, m.RequestID, m.Status
	}
	return []any{t, u, r, st}
}

// selectExpired locks a page of the expired reservations: open, with
// neither an actual nor a release, reserved before $1, in the order of
// (reserved_at, key) after ($2 to $5), so that a pass goes past the rows
// it leaves open. It skips a row a batch holds (SKIP LOCKED), which is
// getting an event: the next pass sees what the batch made of it.
const selectExpired = `
SELECT tenant, user_id, request_id, plan, endpoint, estimated_tokens, reserved_at, local, day
FROM reservations
WHERE status = 'open' AND actual_tokens IS NULL AND released_at IS NULL AND reserved_at < $1
    AND (reserved_at, tenant, user_id, request_id) > ($2::timestamptz, $3, $4, $5)
ORDER BY reserved_at, tenant, user_id, request_id LIMIT $6
FOR UPDATE SKIP LOCKED`

// BeginExpired begins a transaction that locks up to limit open
// reservations reserved before cutoff with neither an actual nor a release
// and returns them, oldest first, after the row after (the zero
// Reservation: from the first) in that order. The caller settles them in
// Redis meanwhile and Commits the marks of those Redis settled
// (StatusExpired, StatusExpiredReleased): a batch bringing an event of one
// waits for the commit, and finds it expired.
func (s *Store) BeginExpired(ctx context.Context, cutoff time.Time, after Reservation, limit int) (*Tx, []Reservation, error) {
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("select expired reservations: %w", err)
	}
	t := &Tx{conn: conn, days: make(map[Key]time.Time, limit)}
	var out []Reservation
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	b.Queue(selectExpired, cutoff, after.ReservedAt, after.Tenant, after.User, after.RequestID, limit).Query(func(rows pgx.Rows) error {
		v := Reservation{Actual: -1, Status: StatusOpen}
		var day time.Time
		_, err := pgx.ForEachRow(rows, []any{&v.Tenant, &v.User, &v.RequestID, &v.Plan, &v.Endpoint, &v.Estimate, &v.ReservedAt, &v.Local, &day}, func() error {
			v.At = v.ReservedAt
			out = append(out, v)
			t.days[v.Key] = day
			return nil
		})
		return err
	})
	if err := conn.SendBatch(ctx, b).Close(); err != nil {
		t.Rollback(ctx)
		return nil, nil, fmt.Errorf("select expired reservations: %w", err)
	}
	return t, out, nil
}

// Usage is what the windows of a subject hold for its reservations at one
// time (to the second), for the rebuild of Redis.
type Usage struct {
	Tenant, User   string
	Plan, Endpoint string
	At             time.Time
	Tokens         int64
}

// usageQuery sums, per subject, plan, endpoint and second, what Redis
// holds for each reservation since $1 given its status: the actual once
// settled, nothing once released, the estimate while open (the pending
// actual will correct it) or once expired at the estimate; nothing before
// it is settled for a reservation decided without Redis (local), whose
// actual is charged in full. where narrows the reservations.
func usageQuery(where string) string {
	return `
SELECT tenant, user_id, plan, endpoint, date_trunc('second', at) AS sec, sum(tokens)::bigint
FROM (
    SELECT tenant, user_id, plan, endpoint, coalesce(reserved_at, actual_at, released_at) AS at,
        ` + heldTokens + ` AS tokens
    FROM reservations
    WHERE coalesce(reserved_at, actual_at, released_at) >= $1` + where + `
) u
GROUP BY tenant, user_id, plan, endpoint, sec
HAVING sum(tokens) <> 0
ORDER BY tenant, user_id, sec`
}

var (
	selectUsage = usageQuery("")
	// selectUsageOf reads one tenant ($2), or one of its users ($3).
	selectUsageOf = usageQuery(" AND tenant = $2 AND ($3 = '' OR user_id = $3)")
)

// UsageSince calls f for the usage of every subject since since, ordered
// by subject then time. It reads one consistent snapshot.
func (s *Store) UsageSince(ctx context.Context, since time.Time, f func(Usage) error) error {
	return s.usage(ctx, f, selectUsage, since)
}

// UsageOf calls f for the usage since since of one subject of tenant, or
// of all its users when user is empty, ordered by user then time.
func (s *Store) UsageOf(ctx context.Context, since time.Time, tenant, user string, f func(Usage) error) error {
	return s.usage(ctx, f, selectUsageOf, since, tenant, user)
}

func (s *Store) usage(ctx context.Context, f func(Usage) error, query string, args ...any) error {
	rows, err := s.pool.Query(ctx, query, args...)
	if err != nil {
		return fmt.Errorf("select usage: %w", err)
	}
	var u Usage
	_, err = pgx.ForEachRow(rows, []any{&u.Tenant, &u.User, &u.Plan, &u.Endpoint, &u.At, &u.Tokens}, func() error { return f(u) })
	if err != nil {
		return fmt.Errorf("select usage: %w", err)
	}
	return nil
}

// Recent is a reservation whose Redis record would still exist: open and
// reserved within the reservation TTL, or settled or released within it.
// A rebuild of Redis puts the record back (rebuild.Rebuilder).
type Recent struct {
	Key
	Plan, Endpoint, Model string
	Status                string
	Estimate              int64     // -1 when no reserved event arrived
	At                    time.Time // when its usage counts (Reservation.At)
	// Since is when its record's TTL runs from: its reservation while
	// open, its settlement after.
	Since time.Time
	Local bool
}

// selectRecent reads the reservations of the last $1 (twice the TTL: one
// settled within the TTL was reserved at most a TTL before that) whose
// record would still live: open ones reserved since $2 (now - TTL), settled
// or released ones settled since $2. The index on coalesce(reserved_at,
// actual_at, released_at) serves the range.
const selectRecent = `
SELECT tenant, user_id, request_id, plan, endpoint, model, status, coalesce(estimated_tokens, -1),
    coalesce(reserved_at, actual_at, released_at), coalesce(settled_at, reserved_at), local
FROM reservations
WHERE coalesce(reserved_at, actual_at, released_at) >= $1
    AND (status = 'open' AND reserved_at >= $2 OR status IN ('settled', 'released') AND settled_at >= $2)`

// RecentSince calls f for every reservation whose Redis record would
// still exist, given the reservation ttl.
func (s *Store) RecentSince(ctx context.Context, now time.Time, ttl time.Duration, f func(Recent) error) error {
	rows, err := s.pool.Query(ctx, selectRecent, now.Add(-2*ttl), now.Add(-ttl))
	if err != nil {
		return fmt.Errorf("select recent reservations: %w", err)
	}
	var r Recent
	_, err = pgx.ForEachRow(rows, []any{&r.Tenant, &r.User, &r.RequestID, &r.Plan, &r.Endpoint, &r.Model, &r.Status,
		&r.Estimate, &r.At, &r.Since, &r.Local}, func() error { return f(r) })
	if err != nil {
		return fmt.Errorf("select recent reservations: %w", err)
	}
	return nil
}

// Balance is what a subject's prepaid balance held: every top-up it
// received, and what its requests spent (by the same rules as Usage, over
// all time) by their plan, whose rules say whether Redis spent the balance
// for them. The plan is the reservation row's, empty for a row without one
// (an actual alone, which Redis charged under the tenant's plan) and for
// what dropped partitions spent before migration 011 carried it by plan.
type Balance struct {
	Tenant, User string
	Credited     int64
	Spent        map[string]int64 // by plan; no entry where nothing was spent
}

// heldTokens is what Redis holds for a reservations row given its status
// (the counterpart of correct's fallback): the actual once settled,
// nothing once released, nothing while open for a reservation decided
// without Redis (local), else the estimate (open: the pending actual will
// correct it; expired: settled at it, charged then for a local one).
const heldTokens = `CASE
            WHEN status = 'settled' THEN coalesce(actual_tokens, 0)
            WHEN status IN ('released', 'expired_released') OR (local AND status = 'open') THEN 0
            ELSE coalesce(estimated_tokens, 0)
        END`

// selectBalances sums the top-ups of every subject that received one, and
// by plan what its reservations hold given their status: the rows kept,
// and what the dropped partitions held (balance_carry). A row per subject
// and plan spent under, or one with plan NULL for a subject that spent
// nothing.
const selectBalances = `
SELECT t.tenant, t.user_id, t.credited, s.plan, coalesce(s.spent, 0)
FROM (
    SELECT tenant, user_id, sum(credited)::bigint AS credited
    FROM (
        SELECT tenant, user_id, tokens AS credited
        FROM usage_events WHERE type = 'quotaflow.balance.topup'
        UNION ALL
        SELECT tenant, user_id, credited FROM balance_carry
    ) c
    GROUP BY tenant, user_id
    HAVING sum(credited) > 0
) t
LEFT JOIN LATERAL (
    SELECT plan, sum(spent)::bigint AS spent
    FROM (
        SELECT plan, ` + heldTokens + ` AS spent
        FROM reservations r WHERE r.tenant = t.tenant AND r.user_id = t.user_id
        UNION ALL
        SELECT plan, spent FROM balance_carry c WHERE c.tenant = t.tenant AND c.user_id = t.user_id
    ) u
    GROUP BY plan
    HAVING sum(spent) <> 0
) s ON true
ORDER BY t.tenant, t.user_id`

// Balances calls f for every subject that received a top-up.
func (s *Store) Balances(ctx context.Context, f func(Balance) error) error {
	rows, err := s.pool.Query(ctx, selectBalances)
	if err != nil {
		return fmt.Errorf("select balances: %w", err)
	}
	var (
		b              Balance // the subject being read; Spent nil: none yet
		tenant, user   string
		plan           *string
		credited, used int64
	)
	_, err = pgx.ForEachRow(rows, []any{&tenant, &user, &credited, &plan, &used}, func() error {
		if b.Spent != nil && (tenant != b.Tenant || user != b.User) {
			if err := f(b); err != nil {
				return err
			}
			b.Spent = nil
		}
		if b.Spent == nil {
			b = Balance{Tenant: tenant, User: user, Credited: credited, Spent: map[string]int64{}}
		}
		if plan != nil {
			b.Spent[*plan] = used
		}
		return nil
	})
	if err == nil && b.Spent != nil {
		err = f(b)
	}
	if err != nil {
		return fmt.Errorf("select balances: %w", err)
	}
	return nil
}

// TryLock takes the session advisory lock id on a dedicated connection and
// returns its release function, or ok false when another session holds it.
// The accounter's instances take it around a rebuild of Redis.
func (s *Store) TryLock(ctx context.Context, id int64) (unlock func(), ok bool, err error) {
	c, err := s.pool.Acquire(ctx)
	if err != nil {
		return nil, false, fmt.Errorf("advisory lock: %w", err)
	}
	if err := c.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", id).Scan(&ok); err != nil {
		c.Release()
		return nil, false, fmt.Errorf("advisory lock: %w", err)
	}
	if !ok {
		c.Release()
		return nil, false, nil
	}
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if _, err := c.Exec(ctx, "SELECT pg_advisory_unlock($1)", id); err != nil {
			// A lost unlock must not leave the lock behind on a pooled connection.
			c.Conn().Close(ctx)
		}
		c.Release()
	}, true, nil
}

// IsRejected reports whether err means Postgres refused the data itself
// (SQLSTATE class 22, data exception, e.g. a NUL character, which text
// cannot hold; or 54, program limit exceeded): writing the same record
// again can never succeed, unlike a lost connection.
func IsRejected(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || len(pgErr.Code) < 2 {
		return false
	}
	return pgErr.Code[:2] == "22" || pgErr.Code[:2] == "54"
}

// MarkRebuild records that a rebuild of Redis to epoch starts now, before
// it reads the ledger (see upsertReservations).
func (s *Store) MarkRebuild(ctx context.Context, epoch string) error {
	if _, err := s.pool.Exec(ctx, `INSERT INTO rebuilds (epoch) VALUES ($1)`, epoch); err != nil {
		return fmt.Errorf("record the rebuild: %w", err)
	}
	return nil
}
