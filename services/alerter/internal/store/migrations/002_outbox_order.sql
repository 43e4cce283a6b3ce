-- Deliveries of one order key to one webhook go out strictly in outbox
-- order (docs/design.md §7: a limit's 80, 90 and 100 % alerts in order, a spike's
-- firing before its resolution): Claim hands out a delivery only when no
-- earlier one of its (webhook, order_key) is pending, so a later alert
-- waits while an earlier one waits for its retry. '' orders nothing.
ALTER TABLE webhook_outbox ADD COLUMN order_key text NOT NULL DEFAULT '';
CREATE INDEX webhook_outbox_order ON webhook_outbox (webhook, order_key, id) WHERE status = 'pending';
