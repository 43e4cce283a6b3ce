-- Columns of reservations that nothing reads (issue 13, docs/design.md §6):
-- expires_at (the reservation's expiry as admission announced it: the
-- expiry task goes by reserved_at and the TTL, the rebuild by the status
-- and settled_at) and updated_at (the time of the row's last write). Every
-- row version carried both, 16 bytes of heap and WAL, written by each
-- insert and update. The accounter no longer writes them, so new row
-- versions hold NULL (a bit of the null bitmap). They stay, so that an
-- older release, which writes them, keeps working; updated_at loses its
-- NOT NULL and its default, which changes the catalog only (no rewrite,
-- no scan of the partitions).
SET LOCAL lock_timeout = '2s';
ALTER TABLE reservations ALTER COLUMN updated_at DROP NOT NULL, ALTER COLUMN updated_at DROP DEFAULT;
