-- Named queries of the anonymize key kept in the database (cleanup.anonymize_key).

-- name: lock_anonymize_key
-- One writer of the key at a time (workers starting together, a rotation), until the transaction ends.
SELECT pg_advisory_xact_lock(hashtext('deadline_cleanup.anonymize_key'));

-- name: anonymize_key_fingerprint
SELECT fingerprint FROM anonymize_key WHERE id = 1;

-- name: forget_anonymize_key
DELETE FROM anonymize_key WHERE id = 1;
