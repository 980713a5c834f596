-- An operator's pause of the deadline planner of one task queue, kept where a restart cannot lose
-- it: the planner's own state dies with its run (a watchdog restart, a termination), this row does
-- not. While it exists the planner plans no bucket and sweeps nothing, whichever run is current;
-- with `hold_scheduled`, the bucket cleanups already scheduled wait at their claim as well.
CREATE TABLE planner_pauses (
    task_queue      text PRIMARY KEY,
    reason          text NOT NULL DEFAULT '',
    hold_scheduled  boolean NOT NULL DEFAULT false,
    paused_at       timestamptz NOT NULL DEFAULT now()
);
