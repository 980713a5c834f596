-- no-transaction
-- The claim's order (oldest due first, then by event) as an index range: a claim reads the rows it
-- takes, not every pending row, however long the backlog. It serves every `status = 'pending'`
-- ordered by next_attempt_at that outbox_pending_idx served (dropped in 087).
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_due_idx ON outbox (next_attempt_at, event_id) WHERE status = 'pending';
