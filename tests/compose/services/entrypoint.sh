#!/bin/sh
# `postgres`: initialise an empty $PGDATA like the official image (superuser
# $POSTGRES_USER with $POSTGRES_PASSWORD, database $POSTGRES_DB), then run the server as
# the postgres user on 127.0.0.1:$PGPORT. Anything else (redis-server ...) runs as given.
set -eu
if [ "${1:-}" != postgres ]; then
  exec "$@"
fi
if [ "$(id -u)" = 0 ]; then
  mkdir -p "$PGDATA" /var/run/postgresql
  chown -R postgres:postgres "$PGDATA" /var/run/postgresql
  chmod 700 "$PGDATA"
  exec setpriv --reuid postgres --regid postgres --init-groups "$0" "$@"
fi
user="${POSTGRES_USER:-postgres}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile="$(mktemp)"
  printf '%s' "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}" >"$pwfile"
  initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" --auth-local=trust \
    --auth-host=scram-sha-256 -E UTF8 >/dev/null
  rm -f "$pwfile"
  db="${POSTGRES_DB:-$user}"
  if [ "$db" != postgres ]; then
    postgres --single -D "$PGDATA" -j postgres >/dev/null <<SQL
CREATE DATABASE "$db" OWNER "$user";
SQL
  fi
fi
exec postgres -D "$PGDATA" -c listen_addresses=127.0.0.1
