-- A tenant's recent alerts (GET /v1/alerts, docs/design.md §6, §7) read
-- its outbox rows newest first from this index, never the whole outbox.
-- tern runs a migration in a transaction, so this is a plain CREATE INDEX:
-- the upgrade blocks outbox writes while it builds (about 2 s a million rows).
CREATE INDEX webhook_outbox_tenant_recent ON webhook_outbox (tenant, created_at, id);
