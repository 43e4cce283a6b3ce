-- Event ids are unique per tenant, not across tenants (docs/design.md §6): one
-- tenant's event can never take the place of another's that has the same
-- id. The index on (tenant, user_id, occurred_at) serves per-tenant reads.
ALTER TABLE usage_events DROP CONSTRAINT usage_events_pkey;
ALTER TABLE usage_events ADD PRIMARY KEY (tenant, event_id);
