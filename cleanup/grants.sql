-- Named queries of the targets' privileges (cleanup.grants).

-- name: existing_tables
SELECT n.name FROM unnest($1::text[]) AS n (name) WHERE to_regclass(n.name) IS NOT NULL;

-- name: role_exists
SELECT true FROM pg_roles WHERE rolname = $1;
