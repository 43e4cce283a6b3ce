-- Every rebuild of Redis from the ledger, recorded before the rebuild reads
-- the ledger. A reservation whose reserved event reaches the ledger only
-- after a rebuild, though it was reserved before it, was held by the Redis
-- that lost its data and not by the rebuilt one: it is marked local.
CREATE TABLE rebuilds (
    at    timestamptz PRIMARY KEY DEFAULT clock_timestamp(),
    epoch text        NOT NULL
);
