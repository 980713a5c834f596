-- no-transaction
-- Retention's walks (cleanup/retention.sql), each an index range over what is old enough: the
-- settlements before the cutoff, oldest first, and the reminders delivered before it (the dead
-- ones have outbox_dead_idx).
CREATE INDEX CONCURRENTLY IF NOT EXISTS cleanup_settlements_settled_idx ON cleanup_settlements (settled_at);
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_delivered_idx ON outbox (delivered_at) WHERE status = 'delivered';
