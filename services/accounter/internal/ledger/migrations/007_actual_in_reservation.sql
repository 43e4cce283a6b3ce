-- An actual event is recorded in its reservation row alone (issue 13,
-- docs/design.md §6), as a reserved event already is: the row holds its
-- cost, time, endpoint and model, and now its JSON as the accounter
-- received and checked it (actual_event, unparsed, read by audits as
-- convert_from(actual_event, 'UTF8')::jsonb). A request so writes one row
-- and its index entries, not two. The first actual of a request decides,
-- as Redis's correction does; a later actual of the same request id under
-- another event id changes nothing in Redis and is not recorded either.
-- Rows from before keep their actual in usage_events too (actual_event
-- NULL), and their reservation row already holds its cost and time: the
-- same cost for a request with one actual event; for one with several
-- (other event ids), the largest of those in its first batch (Redis
-- charged the first), while usage_events holds each.
SET LOCAL lock_timeout = '2s';
ALTER TABLE reservations ADD COLUMN actual_event bytea;

-- The hourly totals of actual usage, now from the reservations: the same
-- columns; the same totals for every request with one actual. An hour
-- with an old request of several actuals changes here: it counts the
-- row's one cost and one request, no longer each actual row.
CREATE OR REPLACE VIEW usage_rollups AS
SELECT tenant, user_id, date_trunc('hour', actual_at, 'UTC') AS bucket_start,
    sum(actual_tokens)::bigint AS tokens, count(*) AS requests
FROM reservations
WHERE actual_tokens IS NOT NULL
GROUP BY tenant, user_id, date_trunc('hour', actual_at, 'UTC');
