-- Least privilege for workers: the NOLOGIN role `cleanup_worker` may read and write the
-- application's rows and nothing else: no DDL, no TRUNCATE, no REFERENCES or TRIGGER, owns
-- nothing. Deploy workers as a LOGIN user that is a member of it (docs/security.md):
--
--   CREATE ROLE cleanup_worker_app LOGIN PASSWORD '...' IN ROLE cleanup_worker;
--
-- and run migrations (`python starter.py migrate`) as the owner of the schema. A worker whose
-- database is already migrated only reads `schema_migrations` at start-up (core/db.py).
--
-- Roles are cluster-wide but grants are per database, and every database migrates on its own
-- (the tests clone many): creating the role tolerates it existing (or being created concurrently
-- by another database's migration); the grants are then made in this database.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'cleanup_worker') THEN
        BEGIN
            CREATE ROLE cleanup_worker NOLOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE;
        EXCEPTION
            WHEN duplicate_object OR unique_violation THEN NULL;  -- created meanwhile by another migration
            WHEN insufficient_privilege THEN
                RAISE WARNING 'cannot create role cleanup_worker (needs CREATEROLE); '
                              'create it as an administrator and re-run the grants in 004_worker_role.sql';
        END;
    END IF;

    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'cleanup_worker') THEN
        EXECUTE format('GRANT CONNECT ON DATABASE %I TO cleanup_worker', current_database());
        GRANT USAGE ON SCHEMA public TO cleanup_worker;
        -- Row access to every application table (the declared cleanup targets may include any).
        GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO cleanup_worker;
        -- The migration ledger is read-only to workers.
        REVOKE INSERT, UPDATE, DELETE ON schema_migrations FROM cleanup_worker;
        GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO cleanup_worker;
        GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA public TO cleanup_worker;
        -- Tables, sequences and functions that later migrations create (as the same owner) get the same.
        ALTER DEFAULT PRIVILEGES IN SCHEMA public
            GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO cleanup_worker;
        ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT USAGE, SELECT ON SEQUENCES TO cleanup_worker;
        ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT EXECUTE ON FUNCTIONS TO cleanup_worker;
    END IF;
END
$$;
