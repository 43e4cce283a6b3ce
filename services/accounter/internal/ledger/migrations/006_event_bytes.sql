-- An event's row keeps its JSON as the accounter received and checked it,
-- unparsed (issue 13, docs/design.md §6): parsing it into jsonb was most
-- of Postgres's work for an actual event's row and made the row ~80 bytes
-- larger, and only audits read it, which can parse it then:
-- convert_from(event, 'UTF8')::jsonb. Rows written before keep their jsonb
-- payload; each row has one or the other. No statement here rewrites or
-- scans the table: the check is for new rows (NOT VALID), which old ones
-- meet anyway. The ALTERs need an ACCESS EXCLUSIVE lock: waiting behind a
-- long audit query they would queue every insert behind them, so they give
-- up after lock_timeout; the migration fails whole and the accounter
-- retries it (service.OpenPostgres), not ready meanwhile.
SET LOCAL lock_timeout = '2s';
ALTER TABLE usage_events ALTER COLUMN payload DROP NOT NULL;
ALTER TABLE usage_events ADD COLUMN event bytea;
ALTER TABLE usage_events ADD CONSTRAINT usage_events_one_payload
    CHECK ((payload IS NULL) <> (event IS NULL)) NOT VALID;
