-- One target set per cleanup. Every worker records the fingerprint of the targets it compiled
-- (and the targets themselves, which hold no personal data); the first partition of a cleanup
-- records the set it runs with, and every later partition, `retry-failed` and `--dry-run` must use
-- the same one or refuse, naming both fingerprints.
CREATE TABLE cleanup_target_sets (
    fingerprint      text PRIMARY KEY,
    targets          jsonb NOT NULL,
    first_started_at timestamptz NOT NULL DEFAULT now(),
    last_started_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE cleanup_target_runs (
    cleanup_id   text PRIMARY KEY,
    fingerprint  text NOT NULL,
    recorded_at  timestamptz NOT NULL DEFAULT now()
);
