-- The last time a claim found the database clock far behind the instant its durable timer fired
-- for (the renewal rule's clock, cleanup_clock(), against Temporal's): one row per task queue, for
-- `planner status`. Such a claim does not run ahead of the database clock, nor give up: it fails
-- (retryably) and looks again until the database clock reaches the instant.
CREATE TABLE database_clock_behind (
    task_queue      text PRIMARY KEY,
    behind_seconds  double precision NOT NULL,
    instant         timestamptz NOT NULL,
    cleanup_id      text NOT NULL,
    observed_at     timestamptz NOT NULL DEFAULT now()
);
