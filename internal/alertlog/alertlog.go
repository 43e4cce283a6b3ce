// Package alertlog is a tenant's recent alerts, as its webhooks received
// them (docs/design.md §6): their one JSON shape (Alert, List), the query
// over the alerter's webhook outbox (Recent), the alerter's authenticated
// GET /v1/alerts over it (NewHandler), and the accounter's client of that
// endpoint (Client), for when the alerter keeps its outbox in another
// database than the accounter's ledger.
package alertlog

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// ErrNoOutbox is Recent's answer for a database that holds no alerter
// outbox: the alerter keeps its state in another database.
var ErrNoOutbox = errors.New("the alerter's outbox is not in this database")

// Alert is one alert the alerter raised for a tenant, as its webhooks
// received it.
type Alert struct {
	ID        string    `json:"id"`
	At        time.Time `json:"at"`
	Kind      string    `json:"kind"`
	User      string    `json:"user,omitempty"`
	Limit     string    `json:"limit,omitempty"`
	Threshold int       `json:"threshold,omitempty"` // percent; 0 when not a threshold's
}

// List is the body of GET /v1/alerts, the accounter's and the alerter's.
type List struct {
	Alerts []Alert `json:"alerts"`
}

// The bounds of a page of alerts, and of every list of the accounter's
// usage API (its history package takes them from here), so the alerter
// accepts every page the accounter forwards.
const (
	DefaultLimit = 50
	MaxLimit     = 500
	MaxOffset    = 10000
)

// Querier runs a query: a *pgxpool.Pool.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// selectRecent reads a tenant's most recent alerts from the alerter's
// webhook outbox (one row per alert and webhook: each alert once, by its
// first row), newest first: by time, then by the order the alerter
// enqueued them (alerts of one batch share its transaction's time). It
// walks webhook_outbox_tenant_recent backwards and stops at the page, so
// its cost follows offset+limit, not the tenant's outbox; a DISTINCT ON
// would read and sort every row of the tenant. The webhook body is the
// alert (detect.Alert), parsed for the page's rows alone.
const selectRecent = `
SELECT a.alert_id, a.created_at, a.kind, coalesce(d."user", ''), coalesce(d.limit_name, ''), coalesce(d.threshold, 0)
FROM (SELECT o.alert_id, o.created_at, o.id, o.kind, o.payload
    FROM webhook_outbox o
    WHERE o.tenant = $1 AND NOT EXISTS (SELECT 1 FROM webhook_outbox e
        WHERE e.alert_id = o.alert_id AND e.tenant = o.tenant AND (e.created_at, e.id) < (o.created_at, o.id))
    ORDER BY o.created_at DESC, o.id DESC
    LIMIT $2 OFFSET $3) a
LEFT JOIN LATERAL jsonb_to_record(convert_from(a.payload, 'UTF8')::jsonb -> 'data')
    AS d("user" text, limit_name text, threshold int) ON true
ORDER BY a.created_at DESC, a.id DESC`

// Recent returns tenant's most recent alerts in db, newest first: limit of
// them after the first offset. The caller has checked that its caller may
// read tenant. A database without the outbox answers ErrNoOutbox.
func Recent(ctx context.Context, db Querier, tenant string, limit, offset int) ([]Alert, error) {
	rows, err := db.Query(ctx, selectRecent, tenant, limit, offset)
	if err == nil {
		var out []Alert
		out, err = pgx.CollectRows(rows, pgx.RowToStructByPos[Alert])
		if err == nil {
			return out, nil
		}
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == "42P01" { // undefined_table
		return nil, ErrNoOutbox
	}
	return nil, fmt.Errorf("alerts of %s: %w", tenant, err)
}
