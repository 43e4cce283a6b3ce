-- Time partitions of the ledger (issue 17, docs/design.md §6): reservations
-- and usage_events are partitioned by day, the UTC date on which the
-- accounter first wrote the row (received, not when the event says it
-- happened: a request's events carry different times, and a late or
-- replayed event must still find a partition), so that the retention task
-- drops whole partitions instead of deleting rows (Partitions.Retain).
--
-- Postgres requires the partition key in every unique key, so the dedup
-- that must hold across partitions lives in tables of its own:
-- reservation_keys holds each request's key and the day of its row (the
-- row is found by its key whichever event came first), event_ids each
-- stored event's id per tenant. The retention task prunes them with the
-- partitions, but for top-up ids, kept for good: a top-up replayed after
-- its row is gone must still not credit twice. Both are written in day
-- order, so a BRIN index on day serves the pruning for almost nothing.
--
-- The rows of the unpartitioned tables are moved into a first partition
-- (MINVALUE to tomorrow, UTC), their keys and ids into the dedup tables,
-- in this migration's transaction: it holds ACCESS EXCLUSIVE locks on
-- both tables until it commits, so every write and read of the ledger
-- waits for it (the accounter is not ready meanwhile); it writes each row
-- twice (its move and its key) and takes about as long as inserting the
-- ledger again (docs/design.md §6 has the measured rate). Older releases
-- cannot write the partitioned tables (their ON CONFLICT has no unique
-- index to name): stop them before this migration runs. The accounter
-- creates the later partitions ahead at start and every hour
-- (Partitions.Ensure).
SET LOCAL lock_timeout = '2s';

CREATE TABLE reservation_keys (
    tenant     text NOT NULL,
    user_id    text NOT NULL,
    request_id text NOT NULL,
    day        date NOT NULL, -- the partition of the request's reservations row
    PRIMARY KEY (tenant, user_id, request_id)
);
CREATE INDEX reservation_keys_day ON reservation_keys USING brin (day);

CREATE TABLE event_ids (
    tenant   text    NOT NULL,
    event_id text    NOT NULL,
    day      date    NOT NULL, -- the partition of the event's usage_events row
    topup    boolean NOT NULL, -- kept after its row is dropped
    PRIMARY KEY (tenant, event_id)
);
CREATE INDEX event_ids_day ON event_ids USING brin (day);

-- What the dropped partitions held of each prepaid balance (Balances adds
-- the rows still kept): top-ups credited and what reservations spent.
CREATE TABLE balance_carry (
    tenant   text   NOT NULL,
    user_id  text   NOT NULL,
    credited bigint NOT NULL DEFAULT 0,
    spent    bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, user_id)
);

DROP VIEW usage_rollups;
ALTER TABLE reservations RENAME TO reservations_unpartitioned;
ALTER TABLE reservations_unpartitioned DROP CONSTRAINT reservations_pkey;
DROP INDEX reservations_unsettled, reservations_at;
ALTER TABLE usage_events RENAME TO usage_events_unpartitioned;
ALTER TABLE usage_events_unpartitioned DROP CONSTRAINT usage_events_pkey;
DROP INDEX usage_events_subject, usage_events_denials;

CREATE TABLE reservations (
    tenant           text        NOT NULL,
    user_id          text        NOT NULL,
    request_id       text        NOT NULL,
    plan             text        NOT NULL DEFAULT '',
    endpoint         text        NOT NULL DEFAULT '',
    model            text        NOT NULL DEFAULT '',
    estimated_tokens bigint,
    actual_tokens    bigint,
    status           text        NOT NULL DEFAULT 'open'
        CHECK (status IN ('open', 'settled', 'released', 'expired', 'expired_released')),
    reserved_at      timestamptz,
    expires_at       timestamptz,
    actual_at        timestamptz,
    released_at      timestamptz,
    settled_at       timestamptz,
    updated_at       timestamptz NOT NULL DEFAULT now(),
    local            boolean     NOT NULL DEFAULT false,
    prior_status     text,
    actual_event     bytea,
    day              date        NOT NULL DEFAULT (now() AT TIME ZONE 'UTC')::date,
    PRIMARY KEY (tenant, user_id, request_id, day)
) PARTITION BY RANGE (day);
CREATE INDEX reservations_unsettled ON reservations (reserved_at)
    WHERE status = 'open' AND actual_tokens IS NULL AND released_at IS NULL;
CREATE INDEX reservations_at ON reservations ((coalesce(reserved_at, actual_at, released_at)));

CREATE TABLE usage_events (
    event_id    text        NOT NULL,
    type        text        NOT NULL,
    tenant      text        NOT NULL,
    user_id     text        NOT NULL,
    request_id  text        NOT NULL DEFAULT '',
    tokens      bigint      NOT NULL,
    occurred_at timestamptz NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(),
    payload     jsonb,
    event       bytea,
    day         date        NOT NULL DEFAULT (now() AT TIME ZONE 'UTC')::date,
    CONSTRAINT usage_events_one_payload CHECK ((payload IS NULL) <> (event IS NULL)),
    PRIMARY KEY (tenant, event_id, day)
) PARTITION BY RANGE (day);
CREATE INDEX usage_events_subject ON usage_events (tenant, user_id, occurred_at);
CREATE INDEX usage_events_denials ON usage_events (tenant, occurred_at) WHERE type = 'quotaflow.usage.denied';

DO $$
DECLARE
    tomorrow date := (now() AT TIME ZONE 'UTC')::date + 1;
BEGIN
    EXECUTE format('CREATE TABLE reservations_first PARTITION OF reservations FOR VALUES FROM (MINVALUE) TO (%L)', tomorrow);
    EXECUTE format('CREATE TABLE usage_events_first PARTITION OF usage_events FOR VALUES FROM (MINVALUE) TO (%L)', tomorrow);
END $$;

INSERT INTO reservations (tenant, user_id, request_id, plan, endpoint, model, estimated_tokens, actual_tokens,
    status, reserved_at, expires_at, actual_at, released_at, settled_at, updated_at, local, prior_status, actual_event)
SELECT tenant, user_id, request_id, plan, endpoint, model, estimated_tokens, actual_tokens,
    status, reserved_at, expires_at, actual_at, released_at, settled_at, updated_at, local, prior_status, actual_event
FROM reservations_unpartitioned;
INSERT INTO reservation_keys (tenant, user_id, request_id, day)
SELECT tenant, user_id, request_id, day FROM reservations;
DROP TABLE reservations_unpartitioned;

INSERT INTO usage_events (event_id, type, tenant, user_id, request_id, tokens, occurred_at, received_at, payload, event)
SELECT event_id, type, tenant, user_id, request_id, tokens, occurred_at, received_at, payload, event
FROM usage_events_unpartitioned;
INSERT INTO event_ids (tenant, event_id, day, topup)
SELECT tenant, event_id, day, type = 'quotaflow.balance.topup' FROM usage_events;
DROP TABLE usage_events_unpartitioned;

CREATE VIEW usage_rollups AS
SELECT tenant, user_id, date_trunc('hour', coalesce(reserved_at, actual_at, released_at), 'UTC') AS bucket_start,
    coalesce(sum(actual_tokens), 0)::bigint AS tokens, count(*) FILTER (WHERE estimated_tokens IS NOT NULL) AS requests
FROM reservations
GROUP BY tenant, user_id, date_trunc('hour', coalesce(reserved_at, actual_at, released_at), 'UTC');
