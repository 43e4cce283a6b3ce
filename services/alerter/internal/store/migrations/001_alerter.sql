-- The alerter's durable state (docs/design.md §7). Applied by tern under an advisory
-- lock and recorded in alerter_schema_version.

-- The last snapshot version seen per subject (scope 'user': the subject's
-- version; scope 'tenant': the tenant's version, user_id ''). Older
-- snapshots are ignored.
CREATE TABLE alert_versions (
    tenant     text   NOT NULL,
    user_id    text   NOT NULL,
    scope      text   NOT NULL,
    version    bigint NOT NULL,
    PRIMARY KEY (tenant, user_id, scope)
);

-- Threshold state per limit: level is the highest threshold fired and not
-- re-armed (0, 80, 90 or 100); every threshold at or below it is fired,
-- every one above it armed. fires counts firings, so each alert id is new.
CREATE TABLE alert_limits (
    tenant     text        NOT NULL,
    user_id    text        NOT NULL,           -- '' for tenant-scope limits
    scope      text        NOT NULL,
    endpoint   text        NOT NULL DEFAULT '',
    name       text        NOT NULL,
    level      integer     NOT NULL DEFAULT 0,
    fires      bigint      NOT NULL DEFAULT 0,
    last_used  bigint      NOT NULL DEFAULT 0,
    reset_at   timestamptz,                     -- when the window last seen resets
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, user_id, scope, endpoint, name)
);

-- Denial-spike state per tenant (endpoint '') or endpoint (tenant '').
CREATE TABLE alert_spikes (
    tenant     text        NOT NULL,
    endpoint   text        NOT NULL,
    firing     boolean     NOT NULL,
    episode    bigint      NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, endpoint)
);

-- The delivery outbox and log: one row per (alert, webhook). status is
-- pending (next_attempt_at says when), delivered or dead.
CREATE TABLE webhook_outbox (
    id              bigserial   PRIMARY KEY,
    alert_id        text        NOT NULL,
    webhook         text        NOT NULL,
    kind            text        NOT NULL,
    tenant          text        NOT NULL DEFAULT '',
    payload         bytea       NOT NULL,
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    status          text        NOT NULL DEFAULT 'pending',
    last_error      text        NOT NULL DEFAULT '',
    last_status     integer     NOT NULL DEFAULT 0,
    created_at      timestamptz NOT NULL DEFAULT now(),
    delivered_at    timestamptz,
    UNIQUE (alert_id, webhook)
);
CREATE INDEX webhook_outbox_due ON webhook_outbox (next_attempt_at) WHERE status = 'pending';
