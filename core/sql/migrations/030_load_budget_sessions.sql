-- A load budget slot belongs to the database session of the worker process that took it
-- (core/budget.py): the process keeps one session open while it has budgeted work, and each slot
-- records that session's backend pid and start time. A slot whose session is gone (the worker
-- died, its connection broke, the server restarted) is free at once, however long its lease;
-- the lease still frees the slot of a holder whose session lives on but who stopped renewing
-- (a frozen process).
--
-- The commit probe's baseline belongs to one run of the server: a restart (a new
-- pg_postmaster_start_time()) forgets it and the probes collected before it, so the slow commits
-- of a freshly started server (cold caches, recovery's checkpoint) make the new baseline instead
-- of reading as stress.
ALTER TABLE load_budget_slots
    ADD COLUMN backend_pid   integer,
    ADD COLUMN backend_start timestamptz;

ALTER TABLE load_budget
    ADD COLUMN probe_baseline_server_start timestamptz;
