-- The load budget's objectives in the terms players and deadlines feel (budget/controller.py,
-- docs/budget.md, docs/decisions/0017-budget-objectives.md).
--
-- Players are sessions doing work: each probe samples whether a session that is not the service's
-- is running a statement, and counts its samples and the busy ones per holder (reset when older
-- than the presence window); each adjustment moves them into load_budget_presence, one row per
-- window, and players are present while the busy share of the samples of the last presence window
-- reaches the threshold.
--
-- The players' objective is an absolute bound on the commit probe's added latency over its quiet
-- baseline (probe_added_ms; probe_ratio stays as an optional second bound).
--
-- The deadline objective: every budgeted cleanup batch names its cohort; load_budget_cohorts keeps
-- each cohort's deadline, its accounts and those done, so the adjustment knows the rate that finishes
-- every cohort within lateness_objective_seconds of its deadline, granted up to the hard share
-- deadline_max_in_flight whatever the players' objective says. `binding` says which objective sets
-- the limits, `projected_finish` when the last cohort known would finish at the rate granted.
ALTER TABLE load_budget
    ADD COLUMN probe_added_ms             double precision CHECK (probe_added_ms > 0 AND probe_added_ms < 'Infinity'),
    ADD COLUMN lateness_objective_seconds double precision
        CHECK (lateness_objective_seconds > 0 AND lateness_objective_seconds < 'Infinity'),
    ADD COLUMN deadline_max_in_flight     integer CHECK (deadline_max_in_flight >= 0 AND deadline_max_in_flight <= 256),
    ADD COLUMN observed_busy_fraction     double precision,
    ADD COLUMN binding                    text,
    ADD COLUMN deadline_rows_per_second   double precision,
    ADD COLUMN deadline_accounts_left     bigint,
    ADD COLUMN deadline_target            timestamptz,
    ADD COLUMN projected_finish           timestamptz;

ALTER TABLE load_budget_probes
    ADD COLUMN presence_n     integer NOT NULL DEFAULT 0,
    ADD COLUMN presence_busy  integer NOT NULL DEFAULT 0,
    ADD COLUMN presence_since timestamptz;

CREATE TABLE load_budget_presence (
    at      timestamptz NOT NULL,
    samples integer NOT NULL,
    busy    integer NOT NULL
);

CREATE TABLE load_budget_cohorts (
    cohort     text PRIMARY KEY,
    deadline   timestamptz NOT NULL,
    accounts   bigint NOT NULL CHECK (accounts >= 0),
    done       bigint NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL
);
