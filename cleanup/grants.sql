-- Named queries of the targets' privileges (cleanup.grants).

-- name: missing_privileges
-- Per declared table ($1) and privilege ($2, same length), those the current role lacks; a table
-- that does not exist is reported by the schema check, not here.
SELECT t.name AS table_name, t.privilege
FROM unnest($1::text[], $2::text[]) AS t (name, privilege)
WHERE to_regclass(t.name) IS NOT NULL AND NOT has_table_privilege(to_regclass(t.name), t.privilege);

-- name: existing_tables
SELECT n.name FROM unnest($1::text[]) AS n (name) WHERE to_regclass(n.name) IS NOT NULL;

-- name: role_exists
SELECT true FROM pg_roles WHERE rolname = $1;
