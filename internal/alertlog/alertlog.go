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

// The bounds of a page of alerts: those of the usage API's lists, so the
// alerter accepts every page the accounter forwards.
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
// webhook outbox (one row per alert and webhook: each alert once), newest
// first: by time, then by the order the alerter enqueued them (alerts of
// one batch share its transaction's time). The webhook body is the alert
// (detect.Alert).
const selectRecent = `
SELECT alert_id, at, kind, coalesce(b->'data'->>'user', ''), coalesce(b->'data'->>'limit_name', ''),
    coalesce((b->'data'->>'threshold')::int, 0)
FROM (SELECT DISTINCT ON (alert_id) alert_id, created_at AS at, id, kind, convert_from(payload, 'UTF8')::jsonb AS b
    FROM webhook_outbox WHERE tenant = $1 ORDER BY alert_id, created_at, id) a
ORDER BY at DESC, id DESC
LIMIT $2 OFFSET $3`

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
