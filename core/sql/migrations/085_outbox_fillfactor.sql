-- A relay's claim changes only unindexed columns (lease, attempts, last attempt): with room left on
-- each page it is a HOT update, which writes no index entry. New pages keep half their space free
-- for it; pages already written are unchanged until rewritten. (SHARE UPDATE EXCLUSIVE: writers go on.)
ALTER TABLE outbox SET (fillfactor = 50);
