package history

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// ErrNoAlerts is Alerts' answer when the ledger's database holds no
// alerter outbox: the alerter keeps its state in another database.
var ErrNoAlerts = errors.New("the alerter's outbox is not in the accounter's database")

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

// selectAlerts reads a tenant's most recent alerts from the alerter's
// webhook outbox (one row per alert and webhook: each alert once), newest
// first. The webhook body is the alert (detect.Alert).
const selectAlerts = `
SELECT alert_id, at, kind, coalesce(b->'data'->>'user', ''), coalesce(b->'data'->>'limit_name', ''),
    coalesce((b->'data'->>'threshold')::int, 0)
FROM (SELECT DISTINCT ON (alert_id) alert_id, created_at AS at, kind, convert_from(payload, 'UTF8')::jsonb AS b
    FROM webhook_outbox WHERE tenant = $1 ORDER BY alert_id, created_at) a
ORDER BY at DESC, alert_id
LIMIT $2 OFFSET $3`

// Alerts returns t's most recent alerts, newest first, one page, from the
// alerter's outbox when it shares the ledger's database (ErrNoAlerts when
// it does not).
func (rd *Reader) Alerts(ctx context.Context, t Tenant, p Page) ([]Alert, error) {
	rows, err := rd.pool.Query(ctx, selectAlerts, t.name, p.Limit, p.Offset)
	if err != nil {
		return nil, alertsErr(t, err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Alert])
	if err != nil {
		return nil, alertsErr(t, err)
	}
	return out, nil
}

func alertsErr(t Tenant, err error) error {
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == "42P01" { // undefined_table
		return ErrNoAlerts
	}
	return fmt.Errorf("alerts of %s: %w", t.name, err)
}
