-- no-transaction
-- outbox_due_idx (086) covers it; one index fewer to write on every outcome a relay records.
DROP INDEX CONCURRENTLY IF EXISTS outbox_pending_idx;
