-- A deadline registered (or moved) sooner than the planner's longest sleep (PLANNER_MAX_IDLE_SECONDS,
-- at most an hour) must not wait for the planner to wake up: the game's transaction notifies channel
-- `deadline_cleanup_due` with this schema's name at commit, and every worker listening on it nudges
-- the planner (worker.py, keep_nudging_planner). One notification per transaction whatever its rows
-- (Postgres folds identical notifications of a transaction), none for a deadline further ahead, none
-- for a claim or a cleanup (they never set renewal_deadline). A lost notification costs what it cost
-- before: the registration waits for the planner's next iteration.
CREATE FUNCTION notify_deadline_due() RETURNS trigger
    LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM pg_notify('deadline_cleanup_due', TG_TABLE_SCHEMA);
    RETURN NULL;
END
$$;

CREATE TRIGGER accounts_deadline_due
    AFTER INSERT OR UPDATE OF renewal_deadline ON accounts
    FOR EACH ROW
    WHEN (NEW.status = 'active' AND NEW.renewal_deadline < clock_timestamp() + interval '1 hour')
    EXECUTE FUNCTION notify_deadline_due();
