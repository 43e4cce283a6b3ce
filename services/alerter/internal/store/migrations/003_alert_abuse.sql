-- Denial bursts alerted and not yet over (docs/design.md §7): per subject
-- (ip '') or per IP (tenant and user_id ''). A restarted alerter, whose
-- counts start empty, knows them, so denials of a burst it alerted that
-- come again (redelivered, or stored twice) do not alert it again.
CREATE TABLE alert_abuse (
    tenant     text        NOT NULL,
    user_id    text        NOT NULL,
    ip         text        NOT NULL,
    alerted_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, user_id, ip)
);
