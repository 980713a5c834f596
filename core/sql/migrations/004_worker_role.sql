-- Least privilege for workers: the NOLOGIN role `cleanup_worker` may read and write the service's
-- rows and nothing else: no DDL, no TRUNCATE, no REFERENCES or TRIGGER, owns nothing. Deploy
-- workers as a LOGIN user that is a member of it (docs/security.md):
--
--   CREATE ROLE cleanup_worker_app LOGIN PASSWORD '...' IN ROLE cleanup_worker;
--
-- and run migrations (`python starter.py migrate`) as the owner of the service schema. The grants
-- are made table by table after every migration run (core/db.py grant_service_tables, and the
-- declared targets by `migrate`): never on a whole schema nor on future objects, so a table the
-- game adds later is never reachable by the workers unless a target declares it.
--
-- Roles are cluster-wide but grants are per database, and every database migrates on its own
-- (the tests clone many): creating the role tolerates it existing (or being created concurrently
-- by another database's migration).
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'cleanup_worker') THEN
        BEGIN
            CREATE ROLE cleanup_worker NOLOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE;
        EXCEPTION
            WHEN duplicate_object OR unique_violation THEN NULL;  -- created meanwhile by another migration
            WHEN insufficient_privilege THEN
                RAISE WARNING 'cannot create role cleanup_worker (needs CREATEROLE); '
                              'create it as an administrator and run `starter.py migrate` again';
        END;
    END IF;

    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'cleanup_worker') THEN
        EXECUTE format('GRANT CONNECT ON DATABASE %I TO cleanup_worker', current_database());
        EXECUTE format('GRANT USAGE ON SCHEMA %I TO cleanup_worker', current_schema());
    END IF;
END
$$;
