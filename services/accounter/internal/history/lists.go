package history

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// UserTotal is one user's usage over a range: the actual cost of its
// requests and how many of them were admitted.
type UserTotal struct {
	User     string `json:"user"`
	Tokens   int64  `json:"tokens"`
	Requests int64  `json:"requests"`
}

// selectTopUsers ranks a tenant's users over a range by tokens (then by
// user, so that pages are stable), reading the range of the index
// reservations_tenant_at.
const selectTopUsers = `
SELECT user_id, coalesce(sum(actual_tokens), 0)::bigint AS tokens, count(*) FILTER (WHERE estimated_tokens IS NOT NULL)
FROM reservations
WHERE tenant = $1 AND coalesce(reserved_at, actual_at, released_at) >= $2
    AND coalesce(reserved_at, actual_at, released_at) < $3
GROUP BY user_id
ORDER BY tokens DESC, user_id
LIMIT $4 OFFSET $5`

// TopUsers returns t's users by tokens used over [from, to), most first,
// one page.
func (rd *Reader) TopUsers(ctx context.Context, t Tenant, from, to time.Time, p Page) ([]UserTotal, error) {
	out, err := collect(ctx, rd, selectTopUsers, []any{t.name, from, to, p.Limit, p.Offset}, pgx.RowToStructByPos[UserTotal])
	if err != nil {
		return nil, fmt.Errorf("top users of %s: %w", t.name, err)
	}
	return out, nil
}

// Denial counts the requests one limit denied over a range.
type Denial struct {
	Scope  string `json:"scope"`
	Limit  string `json:"limit"`
	Denied int64  `json:"denied"`
}

// selectDenials adds up a tenant's denied events over a range by the
// limit that denied (each event counts the denials of one second:
// data.count), reading the partial index usage_events_denials. An event
// keeps its JSON in event (bytes) or, written before migration 006, in
// payload (jsonb).
const selectDenials = `
SELECT coalesce(d->'data'->>'scope', ''), coalesce(d->'data'->>'name', ''), sum((d->'data'->>'count')::bigint)::bigint AS denied
FROM (SELECT coalesce(payload, convert_from(event, 'UTF8')::jsonb) AS d
    FROM usage_events
    WHERE tenant = $1 AND type = 'quotaflow.usage.denied' AND occurred_at >= $2 AND occurred_at < $3) e
GROUP BY 1, 2
ORDER BY denied DESC, 1, 2
LIMIT $4 OFFSET $5`

// Denials returns the denials of t's requests over [from, to) by limit,
// most first, one page.
func (rd *Reader) Denials(ctx context.Context, t Tenant, from, to time.Time, p Page) ([]Denial, error) {
	out, err := collect(ctx, rd, selectDenials, []any{t.name, from, to, p.Limit, p.Offset}, pgx.RowToStructByPos[Denial])
	if err != nil {
		return nil, fmt.Errorf("denials of %s: %w", t.name, err)
	}
	return out, nil
}

// selectTenants lists the tenants of the ledger, a page at a time, by
// walking the primary key of reservations from one tenant to the next
// (a recursive skip scan): Postgres 15 has no skip scan of its own, and
// DISTINCT would read every row.
const selectTenants = `
WITH RECURSIVE t(tenant) AS (
    (SELECT tenant FROM reservations WHERE tenant > $1 ORDER BY tenant LIMIT 1)
    UNION ALL
    SELECT (SELECT r.tenant FROM reservations r WHERE r.tenant > t.tenant ORDER BY r.tenant LIMIT 1)
    FROM t WHERE t.tenant IS NOT NULL
)
SELECT tenant FROM t WHERE tenant IS NOT NULL LIMIT $2`

// Tenants returns up to limit tenants of the ledger after the tenant after
// ("" for the first page), in order: the list only an admin (v.ReadsAll)
// sees; another viewer gets the tenants its token is bound to.
func (rd *Reader) Tenants(ctx context.Context, v Viewer, after string, limit int) ([]string, error) {
	if !v.ReadsAll() {
		return v.Tenants(), nil
	}
	if err := checkID("after", after, false); err != nil {
		return nil, err
	}
	out, err := collect(ctx, rd, selectTenants, []any{after, limit}, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("tenants: %w", err)
	}
	return out, nil
}
