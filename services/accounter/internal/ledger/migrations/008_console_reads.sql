-- The console's reads (issue 16, docs/design.md §6, Usage history API)
-- are ranges of indexes, not scans of the ledger (TestPlans, on a million
-- rows). A tenant's requests over a range read the range of
-- reservations_at (the rebuild's index, in time order like the table):
-- Postgres prefers it to a (tenant, time) index, which would cost every
-- request one more index entry. A tenant's denials read this index,
-- partial so that other events do not write to it. Built in the
-- migration's transaction, so an existing ledger's writes wait for it.
SET LOCAL lock_timeout = '2s';
CREATE INDEX usage_events_denials ON usage_events (tenant, occurred_at) WHERE type = 'quotaflow.usage.denied';

-- The hourly totals: tokens, the actual cost of the requests of the hour;
-- requests, how many of them admission admitted (a reserved event reached
-- the ledger), where before it counted the requests with an actual. A
-- request counts in the hour of its time in the windows: its reservation's,
-- else its first actual's, else its release's. Derived, so nothing to
-- backfill: rows already in the ledger count at once.
CREATE OR REPLACE VIEW usage_rollups AS
SELECT tenant, user_id, date_trunc('hour', coalesce(reserved_at, actual_at, released_at), 'UTC') AS bucket_start,
    coalesce(sum(actual_tokens), 0)::bigint AS tokens, count(*) FILTER (WHERE estimated_tokens IS NOT NULL) AS requests
FROM reservations
GROUP BY tenant, user_id, date_trunc('hour', coalesce(reserved_at, actual_at, released_at), 'UTC');
