-- The accounter's ledger (docs/design.md §6). Applied by tern under an advisory lock
-- and recorded in accounter_schema_version.

-- Every consumed event, once: a redelivery conflicts on event_id.
CREATE TABLE usage_events (
    event_id    text        PRIMARY KEY,
    type        text        NOT NULL,
    tenant      text        NOT NULL,
    user_id     text        NOT NULL,
    request_id  text        NOT NULL DEFAULT '',
    tokens      bigint      NOT NULL,            -- weighted cost (reserved: estimate, actual: actual, released: 0, topup: amount)
    occurred_at timestamptz NOT NULL,            -- the CloudEvent time
    received_at timestamptz NOT NULL DEFAULT now(),
    payload     jsonb       NOT NULL
);
CREATE INDEX usage_events_occurred_at ON usage_events (occurred_at);
CREATE INDEX usage_events_subject ON usage_events (tenant, user_id, occurred_at);

-- The durable copy of each reservation, created by whichever of reserved or
-- actual arrives first. status says what Redis holds:
--   open              nothing settled in Redis yet (the estimate, if any, counts)
--   settled           the actual cost was applied (Correct)
--   released          the estimate was given back (Release)
--   expired           no actual before the TTL: settled at the estimate
--   expired_released  no actual before the TTL: the estimate was given back
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
    PRIMARY KEY (tenant, user_id, request_id)
);
-- The expiry task's scan: open reservations with no actual and no release.
CREATE INDEX reservations_unsettled ON reservations (reserved_at)
    WHERE status = 'open' AND actual_tokens IS NULL AND released_at IS NULL;
-- The rebuild's scan: everything that happened in the longest window.
CREATE INDEX reservations_at ON reservations ((coalesce(reserved_at, actual_at, released_at)));

-- Hourly totals of actual usage per subject, from newly inserted actual events.
CREATE TABLE usage_rollups (
    tenant       text        NOT NULL,
    user_id      text        NOT NULL,
    bucket_start timestamptz NOT NULL,
    tokens       bigint      NOT NULL,
    requests     bigint      NOT NULL,
    PRIMARY KEY (tenant, user_id, bucket_start)
);
