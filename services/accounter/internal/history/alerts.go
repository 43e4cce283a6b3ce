package history

import (
	"context"

	"quotaflow/internal/alertlog"
)

// AlertSource reads a tenant's recent alerts, newest first, one page, as
// a request authorized by authorization (its Authorization header's value)
// may: from the alerter's outbox in the ledger's database (Reader), or from
// the alerter's API (Alerter).
type AlertSource interface {
	Alerts(ctx context.Context, authorization string, t Tenant, p Page) ([]alertlog.Alert, error)
}

// Alerts reads t's alerts from the alerter's outbox when it shares the
// ledger's database (alertlog.ErrNoOutbox when it does not); the viewer's
// authorization is not needed: t is one it may read.
func (rd *Reader) Alerts(ctx context.Context, _ string, t Tenant, p Page) ([]alertlog.Alert, error) {
	ctx, cancel := rd.bound(ctx)
	defer cancel()
	as, err := alertlog.Recent(ctx, rd.pool, t.name, p.Limit, p.Offset)
	return as, timedOut(ctx, err)
}

// Alerter reads the alerts from the alerter's API, presenting the
// viewer's own token: the alerter checks it again (the same tokens).
type Alerter struct {
	Client *alertlog.Client
}

// Alerts is AlertSource.Alerts.
func (a Alerter) Alerts(ctx context.Context, authorization string, t Tenant, p Page) ([]alertlog.Alert, error) {
	return a.Client.Recent(ctx, authorization, t.name, p.Limit, p.Offset)
}
