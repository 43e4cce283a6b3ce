-- A subject's version row is updated at every snapshot handled: free room
-- in each page lets the update stay in its page (HOT, no index entry).
-- Pages written from now on keep it; older ones as they are rewritten.
ALTER TABLE alert_versions SET (fillfactor = 80);
