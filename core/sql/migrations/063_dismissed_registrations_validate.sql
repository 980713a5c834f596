-- The CHECKs of 063 validated: a scan that takes SHARE UPDATE EXCLUSIVE (players' reads and
-- writes go on), in a file of its own so the brief exclusive lock of 063 was not held meanwhile.
ALTER TABLE accounts VALIDATE CONSTRAINT accounts_status_check;
ALTER TABLE cleanup_failed VALIDATE CONSTRAINT cleanup_failed_resolution_check;
ALTER TABLE account_events VALIDATE CONSTRAINT account_events_kind_check;
