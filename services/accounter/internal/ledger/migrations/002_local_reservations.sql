-- A reservation admission decided without Redis (its local mode, while
-- Redis was unreachable or had lost its data: the reserved event carries
-- version 0) holds nothing in any Redis window. Its actual is then charged
-- in full and its release gives nothing back, and a rebuild counts it
-- only once settled.
ALTER TABLE reservations ADD COLUMN local boolean NOT NULL DEFAULT false;
