-- Named queries of the start-up check of the declared cleanup targets (cleanup.target_check).

-- name: target_tables
-- The declared tables (and archives) as the worker's own role sees them: every column with its
-- type, NOT NULL, default, identity and generated flags, and this role's table privileges.
SELECT n.nspname AS schema_name, c.relname AS table_name,
       has_table_privilege(c.oid, 'SELECT') AS can_select,
       has_table_privilege(c.oid, 'INSERT') AS can_insert,
       has_table_privilege(c.oid, 'UPDATE') AS can_update,
       has_table_privilege(c.oid, 'DELETE') AS can_delete,
       array_agg(a.attname::text ORDER BY a.attnum) AS columns,
       array_agg(format_type(a.atttypid, a.atttypmod) ORDER BY a.attnum) AS types,
       array_agg(a.attnotnull ORDER BY a.attnum) AS not_null,
       array_agg(a.atthasdef ORDER BY a.attnum) AS has_default,
       array_agg(a.attidentity::text ORDER BY a.attnum) AS identity,
       array_agg(a.attgenerated::text ORDER BY a.attnum) AS generated
FROM unnest(:schemas::text[], :tables::text[]) AS w (schema_name, table_name)
JOIN pg_namespace n ON n.nspname = w.schema_name
JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = w.table_name AND c.relkind IN ('r', 'p')
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
GROUP BY n.nspname, c.relname, c.oid;

-- name: cascading_foreign_keys
-- Foreign keys whose ON DELETE CASCADE removes rows of a table when a row of one of these tables
-- (:schemas and :tables, pairwise) is deleted: the child, the constraint, and its (child, parent) column pairs.
SELECT pn.nspname AS parent_schema, p.relname AS parent_table,
       cn.nspname AS child_schema, ch.relname AS child_table, con.conname::text AS constraint_name,
       array(SELECT ca.attname::text FROM unnest(con.conkey) WITH ORDINALITY k (attnum, i)
             JOIN pg_attribute ca ON ca.attrelid = con.conrelid AND ca.attnum = k.attnum ORDER BY k.i) AS child_columns,
       array(SELECT pa.attname::text FROM unnest(con.confkey) WITH ORDINALITY k (attnum, i)
             JOIN pg_attribute pa ON pa.attrelid = con.confrelid AND pa.attnum = k.attnum ORDER BY k.i) AS parent_columns
FROM pg_constraint con
JOIN pg_class p ON p.oid = con.confrelid JOIN pg_namespace pn ON pn.oid = p.relnamespace
JOIN pg_class ch ON ch.oid = con.conrelid JOIN pg_namespace cn ON cn.oid = ch.relnamespace
WHERE con.contype = 'f' AND con.confdeltype = 'c'
  AND (pn.nspname, p.relname) IN (SELECT * FROM unnest(:schemas::text[], :tables::text[]))
ORDER BY 1, 2, 3, 4, 5;

-- name: service_schema
-- The schema of the service's own tables (where the idempotency record is, by the search_path).
SELECT n.nspname AS schema_name, current_user AS role_name
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = to_regclass('cleanup_applied');

-- name: table_sizes
-- The declared tables' size (the planner's row estimate and pages, summed over their partitions;
-- analyzed: every partition has an estimate) and their usable indexes: valid, not partial, with
-- the name of each one's first key column.
SELECT n.nspname AS schema_name, c.relname AS table_name,
       coalesce(s.row_estimate, 0)::float8 AS row_estimate, coalesce(s.analyzed, false) AS analyzed,
       coalesce(s.pages, 0)::bigint AS pages,
       coalesce(ix.index_names, '{}') AS index_names, coalesce(ix.index_columns, '{}') AS index_columns
FROM unnest(:schemas::text[], :tables::text[]) AS w (schema_name, table_name)
JOIN pg_namespace n ON n.nspname = w.schema_name
JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = w.table_name AND c.relkind IN ('r', 'p')
LEFT JOIN LATERAL (
    SELECT sum(greatest(l.reltuples, 0)) AS row_estimate, bool_and(l.reltuples >= 0) AS analyzed,
           sum(pg_relation_size(l.oid) / current_setting('block_size')::int) AS pages
    FROM (SELECT c.oid AS relid UNION SELECT relid FROM pg_partition_tree(c.oid)) p  -- the table, or its partitions
    JOIN pg_class l ON l.oid = p.relid AND l.relkind = 'r'
) s ON true
LEFT JOIN LATERAL (
    SELECT array_agg(ic.relname::text ORDER BY ic.relname) AS index_names,
           array_agg(a.attname::text ORDER BY ic.relname) AS index_columns
    FROM pg_index i
    JOIN pg_class ic ON ic.oid = i.indexrelid
    JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = i.indkey[0]
    WHERE i.indrelid = c.oid AND i.indisvalid AND i.indpred IS NULL
) ix ON true
GROUP BY n.nspname, c.relname, s.row_estimate, s.analyzed, s.pages, ix.index_names, ix.index_columns;

-- name: recorded_account_key_type
-- The account keys' type recorded at migrate time (text, uuid or bigint): a follow-up's $1 is an
-- array of it.
SELECT key_type FROM account_key_type WHERE id = 1;
