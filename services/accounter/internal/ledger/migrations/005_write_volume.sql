-- What one accounted request writes (issue 13, docs/design.md §6).
--
-- The hourly rollups are derived, not written: every batch upserted rows
-- that all concurrent batches of the same users wait on, and nothing reads
-- them that cannot read this view of the actual events, which gives the
-- same totals (the rows of a subject come from usage_events_subject).
DROP TABLE usage_rollups;
CREATE VIEW usage_rollups AS
SELECT tenant, user_id, date_trunc('hour', occurred_at, 'UTC') AS bucket_start,
    sum(tokens)::bigint AS tokens, count(*) AS requests
FROM usage_events
WHERE type = 'quotaflow.usage.actual'
GROUP BY tenant, user_id, date_trunc('hour', occurred_at, 'UTC');

-- Nothing reads events by time alone; audits read a subject's events by
-- (tenant, user_id, occurred_at).
DROP INDEX usage_events_occurred_at;

-- A batch writes a reservation's actual and its settlement in one row
-- version: the write sets status 'settled' at once and keeps here the
-- status it found ('open'), which its RETURNING gives the batch (Postgres
-- 15 returns new values only); NULL when the write changed no status. The
-- commit puts the row back if Redis did not take the correction.
ALTER TABLE reservations ADD COLUMN prior_status text;
