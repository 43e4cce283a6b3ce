-- What a dropped partition's reservations spent of the prepaid balances is
-- carried per plan (docs/design.md §6): Redis spends a balance only for
-- requests under a plan whose rules hold it, and the rebuild counts only
-- those (Balances returns the spent by plan). Rows carried before hold
-- plan '' (the tenant's plan), and top-ups are carried under plan ''. An
-- older accounter's retention run fails against the new key (its upsert
-- names (tenant, user_id)) and is tried again; its batches are unaffected.
SET LOCAL lock_timeout = '2s';
ALTER TABLE balance_carry ADD COLUMN plan text NOT NULL DEFAULT '';
ALTER TABLE balance_carry DROP CONSTRAINT balance_carry_pkey, ADD PRIMARY KEY (tenant, user_id, plan);
