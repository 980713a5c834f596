-- The load budget's view from the players' side (core/budget.py, docs/budget.md).
--
-- While a worker has budgeted work in flight or waiting, it times a commit probe (a one-row write
-- that commits, as a player's inventory update does: it waits for the CPU, the WAL insert and the
-- WAL flush like one) every probe interval and adds the latency to its row of load_budget_probes:
-- to the "quiet" sums when no budget slot was held at that moment, else to the "busy" sums. The
-- adjustment compares the busy mean with the quiet baseline; when no quiet probe was seen for a
-- while, it grants nothing for a moment (quiet_until) so the probes measure a baseline again.
ALTER TABLE load_budget
    ADD COLUMN probe_ratio         double precision CHECK (probe_ratio > 1),
    ADD COLUMN probe_baseline_ms   double precision,
    ADD COLUMN probe_baseline_at   timestamptz,
    ADD COLUMN quiet_until         timestamptz,
    ADD COLUMN observed_probe_ms   double precision,
    ADD COLUMN observed_probes     integer;

CREATE TABLE load_budget_probes (
    holder       text PRIMARY KEY,
    probed_at    timestamptz NOT NULL,
    busy_ms_sum  double precision NOT NULL DEFAULT 0,
    busy_n       integer NOT NULL DEFAULT 0,
    quiet_ms_sum double precision NOT NULL DEFAULT 0,
    quiet_n      integer NOT NULL DEFAULT 0
);
