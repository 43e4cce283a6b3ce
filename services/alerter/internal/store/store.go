// Package store is the alerter's durable state in Postgres: the last
// snapshot version per subject, the threshold state of each limit that
// ever fired (one never fired has no row: its state is the zero
// LimitState), the denial-spike state, the denial bursts alerted, and the webhook outbox, which is also the delivery
// log. Its migrations are embedded and applied at start under an advisory
// lock (tern, version table alerter_schema_version).
//
// Detection changes state and enqueues the resulting alerts in one
// transaction (Store.Update), so a crash either loses both or keeps both:
// an alert is never fired without being queued, nor queued twice.
package store

import (
	"cmp"
	"context"
	"embed"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"quotaflow/internal/pgdb"
)

//go:embed migrations/*.sql
var migrations embed.FS

// VersionTable records which migrations ran; it is the alerter's own, so
// the accounter may keep its tables in the same database.
const VersionTable = "alerter_schema_version"

// Migrate applies the alerter's embedded migrations that have not run yet.
func Migrate(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger) error {
	return pgdb.Migrate(ctx, pool, migrations, VersionTable, log)
}

// Store reads and writes the alerter's tables. It is safe for concurrent
// use; create it with New.
type Store struct {
	pool *pgxpool.Pool
}

// New returns a Store on pool (migrated with Migrate).
func New(pool *pgxpool.Pool) *Store { return &Store{pool: pool} }

// Ping checks that Postgres answers.
func (s *Store) Ping(ctx context.Context) error { return s.pool.Ping(ctx) }

// Update runs fn in one transaction and commits when it returns nil.
func (s *Store) Update(ctx context.Context, fn func(tx *Tx) error) error {
	return pgx.BeginFunc(ctx, s.pool, func(t pgx.Tx) error { return fn(&Tx{tx: t}) })
}

// Tx is one transaction of Update. It must not be used after fn returns.
type Tx struct {
	tx      pgx.Tx
	probing bool // probes ran
}

// probes turns sequential scans off for the rest of the transaction, once,
// so that each key of a read finds its row by the index whatever plan
// Postgres cached: a plan made while the table held a page reads it once
// per key (with a join instead, a plan made by the statistics of a
// smaller table read all of it).
func (t *Tx) probes(ctx context.Context) error {
	if t.probing {
		return nil
	}
	if _, err := t.tx.Exec(ctx, `SET LOCAL enable_seqscan = off`); err != nil {
		return err
	}
	t.probing = true
	return nil
}

// LimitKey identifies one limit of one subject; User is empty for
// tenant-scope limits.
type LimitKey struct {
	Tenant   string
	User     string // empty for tenant-scope limits
	Scope    string // "user" or "tenant"
	Endpoint string // set for an endpoint's per-user limit
	Name     string // the limit's name in the policy
}

// LimitState is the threshold state of one limit. The zero value is a
// limit never seen: every threshold armed.
type LimitState struct {
	// Level is the highest threshold fired and not re-armed (0 = none).
	Level int
	// Fires counts the alerts ever fired for this limit.
	Fires int64
	// LastUsed is the used amount of the last snapshot.
	LastUsed int64
	// ResetAt is when the window of the last snapshot resets; zero when
	// unknown.
	ResetAt time.Time
}

const qSpike = `SELECT firing, episode FROM alert_spikes WHERE tenant = $1 AND endpoint = $2 FOR UPDATE`

// Spike returns whether the denial spike of (tenant, endpoint) is firing
// and its episode count (false, 0 when never seen), locking its row.
func (t *Tx) Spike(ctx context.Context, tenant, endpoint string) (firing bool, episode int64, err error) {
	err = t.tx.QueryRow(ctx, qSpike, tenant, endpoint).Scan(&firing, &episode)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, 0, nil
	}
	if err != nil {
		return false, 0, fmt.Errorf("read spike %s %s: %w", tenant, endpoint, err)
	}
	return firing, episode, nil
}

const qSaveSpike = `
INSERT INTO alert_spikes (tenant, endpoint, firing, episode, updated_at) VALUES ($1, $2, $3, $4, now())
ON CONFLICT (tenant, endpoint) DO UPDATE SET firing = EXCLUDED.firing, episode = EXCLUDED.episode, updated_at = now()`

// SaveSpike writes the spike state of (tenant, endpoint).
func (t *Tx) SaveSpike(ctx context.Context, tenant, endpoint string, firing bool, episode int64) error {
	if _, err := t.tx.Exec(ctx, qSaveSpike, tenant, endpoint, firing, episode); err != nil {
		return fmt.Errorf("save spike %s %s: %w", tenant, endpoint, err)
	}
	return nil
}

// AbuseKey identifies a denial burst: of a subject (IP empty) or of an IP
// (Tenant and User empty).
type AbuseKey struct {
	Tenant, User, IP string
}

// SaveAbuse records that the burst of k is alerted and reports whether it
// is new: false when a commit whose result the alerter did not see has
// recorded it already, so its alert is queued already too.
func (t *Tx) SaveAbuse(ctx context.Context, k AbuseKey) (bool, error) {
	err := t.tx.QueryRow(ctx, `INSERT INTO alert_abuse (tenant, user_id, ip) VALUES ($1, $2, $3)
ON CONFLICT (tenant, user_id, ip) DO NOTHING RETURNING true`, k.Tenant, k.User, k.IP).Scan(new(bool))
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("save abuse burst: %w", err)
	}
	return true, nil
}

// EndAbuse forgets the burst of k: it is over.
func (s *Store) EndAbuse(ctx context.Context, k AbuseKey) error {
	_, err := s.pool.Exec(ctx, `DELETE FROM alert_abuse WHERE tenant = $1 AND user_id = $2 AND ip = $3`, k.Tenant, k.User, k.IP)
	if err != nil {
		return fmt.Errorf("end abuse burst: %w", err)
	}
	return nil
}

// Abusing returns the bursts alerted and not yet over.
func (s *Store) Abusing(ctx context.Context) ([]AbuseKey, error) {
	rows, err := s.pool.Query(ctx, `SELECT tenant, user_id, ip FROM alert_abuse`)
	if err != nil {
		return nil, fmt.Errorf("abuse bursts: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (AbuseKey, error) {
		var k AbuseKey
		err := r.Scan(&k.Tenant, &k.User, &k.IP)
		return k, err
	})
	if err != nil {
		return nil, fmt.Errorf("abuse bursts: %w", err)
	}
	return out, nil
}

// FiringSpikes returns the (tenant, endpoint) pairs whose spike is firing.
func (s *Store) FiringSpikes(ctx context.Context) ([][2]string, error) {
	rows, err := s.pool.Query(ctx, `SELECT tenant, endpoint FROM alert_spikes WHERE firing`)
	if err != nil {
		return nil, fmt.Errorf("firing spikes: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) ([2]string, error) {
		var k [2]string
		err := r.Scan(&k[0], &k[1])
		return k, err
	})
	if err != nil {
		return nil, fmt.Errorf("firing spikes: %w", err)
	}
	return out, nil
}

// Alert is one alert to deliver: ID is deterministic (the same firing
// always has the same ID), Payload the webhook body.
type Alert struct {
	ID      string // deterministic per firing
	Kind    string // quota.threshold, quota.denial_spike or quota.abuse_suspected
	Tenant  string // empty for an endpoint's spike or an IP's burst
	Payload []byte // the webhook body
	// Order groups the alerts that must reach each webhook in the order
	// they were queued (a limit's thresholds, a spike's firing and
	// resolution): one is not attempted while an earlier one of its group
	// is pending. Empty for an alert with no order to keep.
	Order string
}

const qEnqueue = `
INSERT INTO webhook_outbox (alert_id, webhook, kind, tenant, payload, order_key) VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (alert_id, webhook) DO NOTHING`

// Enqueue queues a for each webhook; an (alert, webhook) already queued
// is left alone.
func (t *Tx) Enqueue(ctx context.Context, a Alert, webhooks []string) error {
	for _, w := range webhooks {
		if _, err := t.tx.Exec(ctx, qEnqueue, a.ID, w, a.Kind, a.Tenant, a.Payload, a.Order); err != nil {
			return fmt.Errorf("enqueue alert %s for %s: %w", a.ID, w, err)
		}
	}
	return nil
}

// Delivery statuses of the outbox.
const (
	StatusPending   = "pending"   // to be attempted at next_attempt_at
	StatusDelivered = "delivered" // a 2xx answer was received
	StatusDead      = "dead"      // given up: too old, refused or unknown webhook
)

// Delivery is one outbox row.
type Delivery struct {
	ID          int64     // the row's id; the outbox order
	AlertID     string    // the alert's deterministic id
	Webhook     string    // the webhook's name
	Kind        string    // the alert kind
	Tenant      string    // the alert's tenant, empty for none
	Payload     []byte    // the webhook body
	Attempts    int       // attempts made (Claim counts the one it hands out)
	Status      string    // StatusPending, StatusDelivered or StatusDead
	LastError   string    // why the last attempt failed; never a URL or secret
	LastStatus  int       // the receiver's last HTTP status, 0 when none
	CreatedAt   time.Time // when the alert was queued
	DeliveredAt time.Time // zero until delivered
}

// qClaim leases the due deliveries, but for those past the max age ($3)
// that were attempted before: they die instead (recording their last
// attempt's outcome may have failed, leaving them pending).
const qClaim = `
WITH due AS (
  SELECT o.id, o.attempts > 0 AND o.created_at + make_interval(secs => $3) <= now() AS expired
  FROM webhook_outbox o
  WHERE o.status = 'pending' AND o.next_attempt_at <= now() AND o.webhook <> ALL($5::text[])
    AND (o.order_key = '' OR NOT EXISTS (
      SELECT 1 FROM webhook_outbox p
      WHERE p.webhook = o.webhook AND p.order_key = o.order_key AND p.status = 'pending' AND p.id < o.id))
  ORDER BY o.next_attempt_at LIMIT $1 FOR UPDATE OF o SKIP LOCKED)
UPDATE webhook_outbox w SET
  status = CASE WHEN due.expired THEN 'dead' ELSE 'pending' END,
  attempts = w.attempts + CASE WHEN due.expired THEN 0 ELSE 1 END,
  next_attempt_at = CASE WHEN due.expired THEN w.next_attempt_at ELSE now() + make_interval(secs => $2) END,
  last_error = CASE WHEN due.expired THEN left('past the max age when due again; last error: ' || w.last_error, $4) ELSE w.last_error END
FROM due WHERE w.id = due.id
RETURNING w.id, w.alert_id, w.webhook, w.kind, w.tenant, w.payload, w.attempts, w.status, w.last_error, w.created_at`

// Claim takes up to n due deliveries, in outbox order, and pushes their next attempt lease
// into the future, so another instance (or this one after a crash) tries
// again only once the lease has passed: a crash mid-attempt costs one more
// delivery at most, never zero. Attempts counts this attempt. A delivery
// with an Alert.Order is taken only when no earlier one of its webhook and
// order is pending, due or waiting for a retry, so backoff never reorders
// a group: the next one becomes due once the earlier is delivered or dead.
// (Waiting ages it: past maxAge its first failure is final.) A delivery
// attempted before and due again past maxAge is returned dead, not
// leased: it dies even when recording its attempts' outcome keeps
// failing. The deliveries of the webhooks in skip are left alone.
func (s *Store) Claim(ctx context.Context, n int, lease, maxAge time.Duration, skip []string) ([]Delivery, error) {
	if skip == nil {
		skip = []string{} // NULL would match no webhook
	}
	rows, err := s.pool.Query(ctx, qClaim, n, lease.Seconds(), maxAge.Seconds(), maxErrorLen, skip)
	if err != nil {
		return nil, fmt.Errorf("claim deliveries: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Delivery, error) {
		var d Delivery
		err := r.Scan(&d.ID, &d.AlertID, &d.Webhook, &d.Kind, &d.Tenant, &d.Payload, &d.Attempts, &d.Status, &d.LastError, &d.CreatedAt)
		return d, err
	})
	if err != nil {
		return nil, fmt.Errorf("claim deliveries: %w", err)
	}
	// RETURNING has no order; the outbox's is the alerts' order.
	slices.SortFunc(out, func(a, b Delivery) int { return cmp.Compare(a.ID, b.ID) })
	return out, nil
}

// Extend renews the lease of delivery id, claimed at attempt attempts,
// for an attempt that starts now, and reports whether it did: not when
// that claim is over (its lease passed and another Claim took it, or it
// ended).
func (s *Store) Extend(ctx context.Context, id int64, attempts int, lease time.Duration) (bool, error) {
	tag, err := s.pool.Exec(ctx, `UPDATE webhook_outbox SET next_attempt_at = now() + make_interval(secs => $3)
WHERE id = $1 AND attempts = $2 AND status = 'pending'`, id, attempts, lease.Seconds())
	if err != nil {
		return false, fmt.Errorf("extend the lease of delivery %d: %w", id, err)
	}
	return tag.RowsAffected() == 1, nil
}

// Delivered marks delivery id done with the receiver's HTTP status.
func (s *Store) Delivered(ctx context.Context, id int64, status int) error {
	_, err := s.pool.Exec(ctx, `UPDATE webhook_outbox SET status = 'delivered', delivered_at = now(),
last_status = $2, last_error = '' WHERE id = $1`, id, status)
	if err != nil {
		return fmt.Errorf("mark delivery %d delivered: %w", id, err)
	}
	return nil
}

const qRetry = `
UPDATE webhook_outbox SET
  status = CASE WHEN $5 OR created_at + make_interval(secs => $4) <= now() THEN 'dead' ELSE 'pending' END,
  next_attempt_at = now() + make_interval(secs => $3), last_error = $2, last_status = $6
WHERE id = $1 RETURNING status`

// Failed records a failed attempt of delivery id: it is retried after
// backoff, unless permanent or the delivery is older than maxAge, in which
// case it is dead. It returns the new status.
func (s *Store) Failed(ctx context.Context, id int64, cause string, httpStatus int, backoff, maxAge time.Duration, permanent bool) (string, error) {
	var st string
	err := s.pool.QueryRow(ctx, qRetry, id, storableError(cause), backoff.Seconds(), maxAge.Seconds(), permanent, httpStatus).Scan(&st)
	if err != nil {
		return "", fmt.Errorf("mark delivery %d failed: %w", id, err)
	}
	return st, nil
}

// maxErrorLen bounds a stored last_error, in bytes (about).
const maxErrorLen = 500

// storableError is cause as a text column takes it: valid UTF-8 without
// NUL (Postgres refuses it) nor other control characters, each byte of
// them escaped as \xNN (a receiver's TLS certificate may name a host
// with them), cut after maxErrorLen bytes.
func storableError(cause string) string {
	var b strings.Builder
	i := 0
	for i < len(cause) && b.Len() < maxErrorLen {
		r, n := utf8.DecodeRuneInString(cause[i:])
		switch {
		case r == utf8.RuneError && n == 1: // not UTF-8
			fmt.Fprintf(&b, `\x%02x`, cause[i])
		case unicode.IsControl(r): // C0, DEL or C1: one byte's value
			fmt.Fprintf(&b, `\x%02x`, r)
		default:
			b.WriteString(cause[i : i+n])
		}
		i += n
	}
	if i < len(cause) {
		b.WriteString("…")
	}
	return b.String()
}

// pruneBatch bounds the rows one DELETE of PruneOutbox removes, so the
// first prune of a large outbox holds no long transaction.
const pruneBatch = 10000

const qPruneOutbox = `
DELETE FROM webhook_outbox WHERE id IN (
    SELECT id FROM webhook_outbox WHERE status <> 'pending' AND created_at < $1 LIMIT $2)`

// PruneOutbox deletes the delivered and dead deliveries created before
// before, and returns how many it deleted. Pending ones stay, whatever
// their age.
func (s *Store) PruneOutbox(ctx context.Context, before time.Time) (int64, error) {
	var total int64
	for {
		tag, err := s.pool.Exec(ctx, qPruneOutbox, before, pruneBatch)
		if err != nil {
			return total, fmt.Errorf("prune the outbox: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < pruneBatch {
			return total, nil
		}
	}
}

const qDeliveries = `
SELECT id, alert_id, webhook, kind, tenant, payload, attempts, status, last_error, last_status, created_at, delivered_at
FROM webhook_outbox WHERE ($1 = '' OR kind = $1) ORDER BY id`

// Deliveries lists the delivery log, oldest first, of alerts of kind (all
// when empty).
func (s *Store) Deliveries(ctx context.Context, kind string) ([]Delivery, error) {
	rows, err := s.pool.Query(ctx, qDeliveries, kind)
	if err != nil {
		return nil, fmt.Errorf("list deliveries: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Delivery, error) {
		var d Delivery
		var at *time.Time
		err := r.Scan(&d.ID, &d.AlertID, &d.Webhook, &d.Kind, &d.Tenant, &d.Payload, &d.Attempts, &d.Status,
			&d.LastError, &d.LastStatus, &d.CreatedAt, &at)
		if at != nil {
			d.DeliveredAt = *at
		}
		return d, err
	})
	if err != nil {
		return nil, fmt.Errorf("list deliveries: %w", err)
	}
	return out, nil
}

// VersionKey identifies the version row of a subject: scope "user" with
// the user's id, or scope "tenant" with User empty.
type VersionKey struct {
	Tenant string // the subject's tenant
	User   string // empty for scope "tenant"
	Scope  string // "user" or "tenant"
}

// qVersionsFor reads and locks the keys' rows, each by a probe of the
// key index (probes), in the order of the keys.
const qVersionsFor = `
SELECT v.tenant, v.user_id, v.scope, v.version
FROM unnest($1::text[], $2::text[], $3::text[]) AS k(tenant, user_id, scope)
CROSS JOIN LATERAL (
  SELECT * FROM alert_versions v WHERE v.tenant = k.tenant AND v.user_id = k.user_id AND v.scope = k.scope
  FOR UPDATE) v`

// Versions returns the recorded versions of keys in one query (keys never
// seen are absent), locking their rows until the transaction ends.
func (t *Tx) Versions(ctx context.Context, keys []VersionKey) (map[VersionKey]int64, error) {
	out := make(map[VersionKey]int64, len(keys))
	if len(keys) == 0 {
		return out, nil
	}
	keys = slices.Compact(slices.SortedFunc(slices.Values(keys), compareVersionKeys))
	ts, us, ss := make([]string, len(keys)), make([]string, len(keys)), make([]string, len(keys))
	for i, k := range keys {
		ts[i], us[i], ss[i] = k.Tenant, k.User, k.Scope
	}
	if err := t.probes(ctx); err != nil {
		return nil, fmt.Errorf("read versions: %w", err)
	}
	rows, err := t.tx.Query(ctx, qVersionsFor, ts, us, ss)
	if err != nil {
		return nil, fmt.Errorf("read versions: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var k VersionKey
		var v int64
		if err := rows.Scan(&k.Tenant, &k.User, &k.Scope, &v); err != nil {
			return nil, fmt.Errorf("read versions: %w", err)
		}
		out[k] = v
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read versions: %w", err)
	}
	return out, nil
}

// qSaveVersions raises the rows that exist and inserts the others, each
// found by a probe of the key index (the upsert's arbiter): a join of the
// keys with the table, planned by the statistics of the moment a prepared
// statement's plan was cached, read the whole table while it grew (an
// anti-join with it read the table once per key). An upsert locks each row
// it finds before its WHERE, a WAL record of its own even for a version it
// then leaves. The rows come sorted, so one statement locks in one order
// (see compareVersionKeys).
const qSaveVersions = `
INSERT INTO alert_versions (tenant, user_id, scope, version)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[])
ON CONFLICT (tenant, user_id, scope) DO UPDATE SET version = EXCLUDED.version
WHERE alert_versions.version < EXCLUDED.version`

// SaveVersions records versions in one statement of the transaction; a
// recorded version is only ever raised.
func (t *Tx) SaveVersions(ctx context.Context, versions map[VersionKey]int64) error {
	return saveVersions(ctx, t.tx, versions)
}

// SaveVersions records versions in one statement, outside any
// transaction: the batch whose snapshots change no threshold state moves
// only versions, and a recorded version is only ever raised.
func (s *Store) SaveVersions(ctx context.Context, versions map[VersionKey]int64) error {
	return saveVersions(ctx, s.pool, versions)
}

// compareVersionKeys orders keys as every statement here locks their rows
// (a batch's transaction locks every version it writes in its first
// statement, then its limits: detect.Detector.snapshots).
func compareVersionKeys(a, b VersionKey) int {
	return cmp.Or(strings.Compare(a.Tenant, b.Tenant), strings.Compare(a.User, b.User), strings.Compare(a.Scope, b.Scope))
}

// execer is what runs a statement: a transaction or the pool.
type execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

func saveVersions(ctx context.Context, db execer, versions map[VersionKey]int64) error {
	if len(versions) == 0 {
		return nil
	}
	keys := slices.SortedFunc(maps.Keys(versions), compareVersionKeys)
	n := len(keys)
	ts, us, ss, vs := make([]string, 0, n), make([]string, 0, n), make([]string, 0, n), make([]int64, 0, n)
	for _, k := range keys {
		ts, us, ss, vs = append(ts, k.Tenant), append(us, k.User), append(ss, k.Scope), append(vs, versions[k])
	}
	if _, err := db.Exec(ctx, qSaveVersions, ts, us, ss, vs); err != nil {
		return fmt.Errorf("save versions: %w", err)
	}
	return nil
}

const qRaised = `
SELECT tenant, user_id, scope, endpoint, name, level FROM alert_limits WHERE level > 0 LIMIT $1`

// RaisedLimits returns the level of every limit with a threshold fired and
// not re-armed (level above 0), when there are at most max of them;
// complete is false, and levels nil, when there are more.
func (s *Store) RaisedLimits(ctx context.Context, max int) (levels map[LimitKey]int, complete bool, err error) {
	rows, err := s.pool.Query(ctx, qRaised, max+1)
	if err != nil {
		return nil, false, fmt.Errorf("raised limits: %w", err)
	}
	defer rows.Close()
	levels = map[LimitKey]int{}
	for rows.Next() {
		var k LimitKey
		var lvl int
		if err := rows.Scan(&k.Tenant, &k.User, &k.Scope, &k.Endpoint, &k.Name, &lvl); err != nil {
			return nil, false, fmt.Errorf("raised limits: %w", err)
		}
		levels[k] = lvl
	}
	if err := rows.Err(); err != nil {
		return nil, false, fmt.Errorf("raised limits: %w", err)
	}
	if len(levels) > max {
		return nil, false, nil
	}
	return levels, true, nil
}

// Defined is the limits a policy defines, as their states are keyed:
// user-scope limits by (endpoint, name), a plan's with endpoint "";
// tenant-scope limits by (tenant, name). Build it with Define and Has.
type Defined struct {
	user, tenant map[[2]string]bool
}

// Define adds a user-scope limit (endpoint "" for a plan's) or, with
// scope "tenant", a tenant's own limit (key is then the tenant).
func (d *Defined) Define(scope, key, name string) {
	m := &d.user
	if scope == "tenant" {
		m = &d.tenant
	}
	if *m == nil {
		*m = map[[2]string]bool{}
	}
	(*m)[[2]string{key, name}] = true
}

// Has reports whether k's limit is defined.
func (d Defined) Has(k LimitKey) bool {
	if k.Scope == "tenant" {
		return d.tenant[[2]string{k.Tenant, k.Name}]
	}
	return d.user[[2]string{k.Endpoint, k.Name}]
}

func pairs(m map[[2]string]bool) (a, b []string) {
	a, b = make([]string, 0, len(m)), make([]string, 0, len(m))
	for k := range m {
		a, b = append(a, k[0]), append(b, k[1])
	}
	return a, b
}

const qReArmUndefined = `
UPDATE alert_limits l SET level = 0, updated_at = now()
WHERE l.level > 0 AND (
       l.scope = 'tenant' AND (l.tenant, l.name) NOT IN (SELECT * FROM unnest($3::text[], $4::text[]))
    OR l.scope <> 'tenant' AND (l.endpoint, l.name) NOT IN (SELECT * FROM unnest($1::text[], $2::text[])))
RETURNING l.tenant, l.user_id, l.scope, l.endpoint, l.name`

// ReArmUndefined sets every raised limit that defined does not hold to
// level 0 and returns their keys: a policy reload removed them, so no
// snapshot will ever lower them, and should the limit come back it starts
// armed. Its firings count stays, so the alerts it fires then have new ids.
func (s *Store) ReArmUndefined(ctx context.Context, defined Defined) ([]LimitKey, error) {
	ue, un := pairs(defined.user)
	tt, tn := pairs(defined.tenant)
	rows, err := s.pool.Query(ctx, qReArmUndefined, ue, un, tt, tn)
	if err != nil {
		return nil, fmt.Errorf("re-arm undefined limits: %w", err)
	}
	keys, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (k LimitKey, err error) {
		err = r.Scan(&k.Tenant, &k.User, &k.Scope, &k.Endpoint, &k.Name)
		return k, err
	})
	if err != nil {
		return nil, fmt.Errorf("re-arm undefined limits: %w", err)
	}
	return keys, nil
}

// qLimits reads and locks the keys' rows as qVersionsFor does.
const qLimits = `
SELECT l.tenant, l.user_id, l.scope, l.endpoint, l.name, l.level, l.fires, l.last_used, l.reset_at
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[]) AS k(tenant, user_id, scope, endpoint, name)
CROSS JOIN LATERAL (
  SELECT * FROM alert_limits l
  WHERE l.tenant = k.tenant AND l.user_id = k.user_id AND l.scope = k.scope AND l.endpoint = k.endpoint AND l.name = k.name
  FOR UPDATE) l`

// Limits returns the states of keys in one query (limits never seen are
// absent: their state is the zero LimitState), locking their rows until
// the transaction ends.
func (t *Tx) Limits(ctx context.Context, keys []LimitKey) (map[LimitKey]LimitState, error) {
	out := make(map[LimitKey]LimitState, len(keys))
	if len(keys) == 0 {
		return out, nil
	}
	keys = slices.SortedFunc(slices.Values(keys), compareLimitKeys)
	n := len(keys)
	ts, us, ss, es, ns := make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	for i, k := range keys {
		ts[i], us[i], ss[i], es[i], ns[i] = k.Tenant, k.User, k.Scope, k.Endpoint, k.Name
	}
	if err := t.probes(ctx); err != nil {
		return nil, fmt.Errorf("read limits: %w", err)
	}
	rows, err := t.tx.Query(ctx, qLimits, ts, us, ss, es, ns)
	if err != nil {
		return nil, fmt.Errorf("read limits: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var k LimitKey
		var st LimitState
		var reset *time.Time
		if err := rows.Scan(&k.Tenant, &k.User, &k.Scope, &k.Endpoint, &k.Name, &st.Level, &st.Fires, &st.LastUsed, &reset); err != nil {
			return nil, fmt.Errorf("read limits: %w", err)
		}
		if reset != nil {
			st.ResetAt = *reset
		}
		out[k] = st
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read limits: %w", err)
	}
	return out, nil
}

// compareLimitKeys orders limit keys as compareVersionKeys does versions.
func compareLimitKeys(a, b LimitKey) int {
	return cmp.Or(strings.Compare(a.Tenant, b.Tenant), strings.Compare(a.User, b.User), strings.Compare(a.Scope, b.Scope),
		strings.Compare(a.Endpoint, b.Endpoint), strings.Compare(a.Name, b.Name))
}

const qSaveLimits = `
INSERT INTO alert_limits (tenant, user_id, scope, endpoint, name, level, fires, last_used, reset_at, updated_at)
SELECT tenant, user_id, scope, endpoint, name, level, fires, last_used, reset_at, now()
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::integer[], $7::bigint[], $8::bigint[], $9::timestamptz[])
  AS x(tenant, user_id, scope, endpoint, name, level, fires, last_used, reset_at)
ON CONFLICT (tenant, user_id, scope, endpoint, name) DO UPDATE SET
  level = EXCLUDED.level, fires = EXCLUDED.fires, last_used = EXCLUDED.last_used,
  reset_at = EXCLUDED.reset_at, updated_at = now()`

// SaveLimits writes the states of several limits in one statement.
func (t *Tx) SaveLimits(ctx context.Context, states map[LimitKey]LimitState) error {
	if len(states) == 0 {
		return nil
	}
	n := len(states)
	ts, us, ss, es, ns := make([]string, 0, n), make([]string, 0, n), make([]string, 0, n), make([]string, 0, n), make([]string, 0, n)
	lv, fs, lu := make([]int32, 0, n), make([]int64, 0, n), make([]int64, 0, n)
	rs := make([]*time.Time, 0, n)
	for _, k := range slices.SortedFunc(maps.Keys(states), compareLimitKeys) {
		st := states[k]
		ts, us, ss, es, ns = append(ts, k.Tenant), append(us, k.User), append(ss, k.Scope), append(es, k.Endpoint), append(ns, k.Name)
		lv, fs, lu = append(lv, int32(st.Level)), append(fs, st.Fires), append(lu, st.LastUsed)
		var reset *time.Time
		if !st.ResetAt.IsZero() {
			r := st.ResetAt
			reset = &r
		}
		rs = append(rs, reset)
	}
	if _, err := t.tx.Exec(ctx, qSaveLimits, ts, us, ss, es, ns, lv, fs, lu, rs); err != nil {
		return fmt.Errorf("save limits: %w", err)
	}
	return nil
}
