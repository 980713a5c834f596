#!/usr/bin/env bash
# A PostgreSQL server sized for this machine (24 GiB, 2 cores), for the floor benchmarks: the machine's own PostgreSQL runs with the
# packaged defaults (128 MB shared buffers, 1 GB max_wal_size), on which the floor's statements of
# 50,000 accounts thrash the buffer cache and every run meets a checkpoint.
#   bash bench/tuned_postgres.sh [DIR] [PORT]     (as root or as the postgres user)
#   DATABASE_URL=postgresql://postgres@127.0.0.1:5433/postgres .venv/bin/python -m bench.cohort_cleanup ...
# Settings as pgtune gives for an OLTP server of this size; fsync and synchronous_commit stay on.
# wal_writer_delay 10ms (default 200ms): the WAL writer writes and flushes the WAL as it comes, so a
# commit does not find ~200 ms of everyone's WAL still to flush while every other backend waits for
# buffer space (LWLock:WALWrite), so large commits do not stall the other backends.
set -euo pipefail
dir="${1:-/work/pg-tuned}"
port="${2:-5433}"
bin="$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)"
as_postgres() { if [ "$(id -u)" = 0 ]; then su postgres -c "$*"; else bash -c "$*"; fi; }
mkdir -p "$dir"
[ "$(id -u)" = 0 ] && chown postgres:postgres "$dir"
if [ ! -f "$dir/data/PG_VERSION" ]; then
  as_postgres "$bin/initdb -D $dir/data -A trust -U postgres" >/dev/null
  cat >>"$dir/data/postgresql.conf" <<CONF
port = $port
listen_addresses = '127.0.0.1'
unix_socket_directories = '/tmp'
shared_buffers = 4GB
effective_cache_size = 16GB
maintenance_work_mem = 1GB
wal_buffers = 64MB
max_wal_size = 8GB
min_wal_size = 1GB
checkpoint_timeout = 30min
checkpoint_completion_target = 0.9
max_connections = 200
wal_writer_delay = 10ms
CONF
fi
as_postgres "$bin/pg_ctl -D $dir/data -l $dir/log -w status" >/dev/null 2>&1 ||
  as_postgres "$bin/pg_ctl -D $dir/data -l $dir/log -w start" >/dev/null
# ready when it answers a query, not when its port opens
for _ in $(seq 200); do
  psql -h 127.0.0.1 -p "$port" -U postgres -Atc "SELECT 1" >/dev/null 2>&1 && break
  sleep 0.3
done
psql -h 127.0.0.1 -p "$port" -U postgres -Atc "SELECT 1" >/dev/null || { echo "no answer on port $port; see $dir/log" >&2; exit 1; }
# TUNED_PRELOAD=pg_stat_statements: the server preloads it (bench.batch_sizes --together then
# reports each size's work per account); TUNED_PRELOAD= switches it off again. Restarts if it changes.
if [ -n "${TUNED_PRELOAD+set}" ] &&
   [ "$(psql -h 127.0.0.1 -p "$port" -U postgres -Atc "SHOW shared_preload_libraries")" != "$TUNED_PRELOAD" ]; then
  psql -h 127.0.0.1 -p "$port" -U postgres -qAtc "ALTER SYSTEM SET shared_preload_libraries = '$TUNED_PRELOAD'"
  as_postgres "$bin/pg_ctl -D $dir/data -l $dir/log -w restart" >/dev/null
  for _ in $(seq 200); do
    psql -h 127.0.0.1 -p "$port" -U postgres -Atc "SELECT 1" >/dev/null 2>&1 && break
    sleep 0.3
  done
fi
echo "postgresql://postgres@127.0.0.1:$port/postgres"
