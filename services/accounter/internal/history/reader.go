package history

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Reader runs the console's queries on the ledger. Create it with
// NewReader; it is safe for concurrent use.
type Reader struct {
	pool    *pgxpool.Pool
	timeout time.Duration // of a read of the ledger (bound)
	windows WindowsSource
	peeks   chan struct{} // a slot per read of Redis under way (MaxPeeks)
}

// NewReader returns a Reader of the ledger in pool (migrated; the
// console's own, configured by PoolOptions) and of the windows in w's
// Redis. timeout bounds each read of the ledger, its wait for one of
// pool's connections included (PoolOptions.QueryTimeout; 0: only ctx).
func NewReader(pool *pgxpool.Pool, timeout time.Duration, w WindowsSource) *Reader {
	if w.MaxPeeks <= 0 {
		w.MaxPeeks = DefaultMaxPeeks
	}
	return &Reader{pool: pool, timeout: timeout, windows: w, peeks: make(chan struct{}, w.MaxPeeks)}
}

// collect runs sql with args on the ledger and collects its rows with to,
// within the read's bound: ErrTimeout past it.
func collect[T any](ctx context.Context, rd *Reader, sql string, args []any, to pgx.RowToFunc[T]) ([]T, error) {
	ctx, cancel := rd.bound(ctx)
	defer cancel()
	rows, err := rd.pool.Query(ctx, sql, args...)
	var out []T
	if err == nil {
		out, err = pgx.CollectRows(rows, to)
	}
	return out, timedOut(ctx, err)
}

// Point is one bucket of a history: Tokens is the actual cost of the
// requests of the bucket, Requests how many of them admission admitted (a
// reserved event reached the ledger). A request counts at its time in the
// windows: its reservation's, else its first actual's, else its release's.
type Point struct {
	Start    time.Time `json:"start"`
	Tokens   int64     `json:"tokens"`
	Requests int64     `json:"requests"`
}

// selectHistory sums a tenant's (or one user's: $2 not empty) reservation
// rows by bucket ($5: 'hour' or 'day', in UTC). The range reads the index
// reservations_tenant_at.
const selectHistory = `
SELECT date_trunc($5, coalesce(reserved_at, actual_at, released_at), 'UTC'),
    coalesce(sum(actual_tokens), 0)::bigint, count(*) FILTER (WHERE estimated_tokens IS NOT NULL)
FROM reservations
WHERE tenant = $1 AND coalesce(reserved_at, actual_at, released_at) >= $3
    AND coalesce(reserved_at, actual_at, released_at) < $4 AND ($2 = '' OR user_id = $2)
GROUP BY 1`

// History returns t's usage (one user's when user is not empty) in every
// bucket of r, in order, zero where nothing happened.
func (rd *Reader) History(ctx context.Context, t Tenant, user string, r Range) ([]Point, error) {
	if err := checkID("user", user, false); err != nil {
		return nil, err
	}
	rows, err := collect(ctx, rd, selectHistory, []any{t.name, user, r.From, r.To, string(r.Step)}, pgx.RowToStructByPos[Point])
	if err != nil {
		return nil, fmt.Errorf("history of %s: %w", t.name, err)
	}
	got := make(map[time.Time]Point, len(rows))
	for _, p := range rows {
		got[p.Start.UTC()] = p
	}
	starts := r.buckets()
	points := make([]Point, len(starts))
	for i, s := range starts {
		points[i] = got[s]
		points[i].Start = s
	}
	return points, nil
}
