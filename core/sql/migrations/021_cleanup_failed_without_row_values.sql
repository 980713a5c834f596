-- cleanup_failed keeps why an account could not be cleaned, never the data that was to be deleted:
-- a DETAIL such as "Failing row contains (...)" or "Key (...)=(...)" quotes the row. The worker now
-- stores the constraint, table and column names in `detail` instead; the details recorded before
-- (PostgreSQL's own) go, and so does a row quoted in a message.
UPDATE cleanup_failed SET detail = NULL WHERE detail IS NOT NULL;
UPDATE cleanup_failed SET message = regexp_replace(message, '\s*Failing row contains \(.*$', '')
WHERE message LIKE '%Failing row contains (%';
