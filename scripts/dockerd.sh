#!/usr/bin/env bash
# A private Docker engine for the tests (and for trying docker-compose.yml on this machine):
# Debian's dockerd with no bridge and no iptables rules, every path under one cache dir, and
# a registry-free base image built once with debootstrap.
#
#   scripts/dockerd.sh start        start the engine (or reuse the one already answering)
#   scripts/dockerd.sh stop         stop it by its pidfile
#   scripts/dockerd.sh base-image   print the local base image, importing it if missing
#   scripts/dockerd.sh env          print `export DOCKER_HOST=...` for a shell
#
# LEASEKEEPER_DOCKER_DIR (default ~/.cache/leasekeeper/docker) holds data/, exec/, the
# socket, the pidfile and the log. Containers must use host networking: this engine has no
# bridge (`network_mode: host`, `docker build --network host`).
set -euo pipefail

dir="${LEASEKEEPER_DOCKER_DIR:-$HOME/.cache/leasekeeper/docker}"
sock="$dir/docker.sock"
pidfile="$dir/dockerd.pid"
export DOCKER_HOST="unix://$sock"

# The base image: Debian bookworm minbase plus this machine's CA bundle (egress may be
# TLS-intercepted; pip inside builds must trust what the host trusts). Keyed by everything
# that goes into it, so a change rebuilds it and an unchanged machine never does.
suite=bookworm
mirror="$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)"
mirror="${mirror:-http://deb.debian.org/debian}"
ca_bundle=/etc/ssl/certs/ca-certificates.crt
base_cache="$(dirname "$dir")/docker-base"

alive() {
  [ -S "$sock" ] && docker info >/dev/null 2>&1
}

start() {
  if alive; then
    return 0
  fi
  if [ "$(id -u)" != 0 ]; then
    echo "dockerd needs root (this is uid $(id -u)); the Docker tests cannot run" >&2
    exit 3
  fi
  command -v dockerd >/dev/null || {
    echo "dockerd is not installed: run scripts/system-deps.sh (Debian's docker.io)" >&2
    exit 3
  }
  mkdir -p "$dir/data" "$dir/exec"
  rm -f "$sock" "$pidfile"
  setsid dockerd --bridge=none --iptables=false --ip6tables=false \
    --data-root "$dir/data" --exec-root "$dir/exec" -H "unix://$sock" \
    --pidfile "$pidfile" --storage-driver overlay2 >>"$dir/dockerd.log" 2>&1 </dev/null &
  local pid=$!
  for _ in $(seq 1 300); do
    if alive; then
      return 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "dockerd exited at start; the end of $dir/dockerd.log:" >&2
      tail -5 "$dir/dockerd.log" >&2
      exit 3
    fi
    sleep 0.1
  done
  echo "dockerd did not answer on $sock within 30 s; see $dir/dockerd.log" >&2
  kill "$pid" 2>/dev/null || true
  exit 3
}

stop() {
  [ -f "$pidfile" ] || return 0
  local pid
  pid="$(cat "$pidfile")"
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 1 300); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  rm -f "$pidfile"
  # dockerd leaves its default network namespace mounted when it dies hard.
  if mountpoint -q "$dir/exec/netns/default" 2>/dev/null; then
    umount "$dir/exec/netns/default" || true
  fi
}

base_key() {
  echo "v1 $suite minbase $mirror" | sha256sum | cut -c1-12
}

trust_key() {
  cat "$ca_bundle" /usr/local/share/ca-certificates/*.crt 2>/dev/null | sha256sum | cut -c1-12
}

# The debootstrap tarball, built once per machine (suite and mirror are its key).
base_tarball() {
  local tarball rootfs
  tarball="$base_cache/$suite-minbase-$(base_key).tar"
  if [ ! -f "$tarball" ]; then
    command -v debootstrap >/dev/null || {
      echo "debootstrap is not installed: run scripts/system-deps.sh" >&2
      exit 3
    }
    mkdir -p "$base_cache"
    rootfs="$(mktemp -d "$base_cache/rootfs.XXXXXX")"
    echo "debootstrap $suite (minbase) from $mirror: once per machine, ~30 s" >&2
    if ! debootstrap --variant=minbase "$suite" "$rootfs" "$mirror" \
        >"$base_cache/debootstrap.log" 2>&1; then
      rm -rf "$rootfs"
      echo "debootstrap failed; see $base_cache/debootstrap.log" >&2
      exit 3
    fi
    rm -rf "$rootfs/var/cache/apt/archives/"*.deb "$rootfs/var/lib/apt/lists/"*
    tar -C "$rootfs" -cf "$tarball.tmp" .
    rm -rf "$rootfs"
    mv "$tarball.tmp" "$tarball"
  fi
  echo "$tarball"
}

# The base image: the tarball imported, plus this machine's CA certificates (egress may be
# TLS-intercepted; pip inside a build must trust what the host trusts). They go where
# update-ca-certificates keeps them, so an `apt-get install ca-certificates` keeps them.
base_image() {
  local bare image ctx
  bare="leasekeeper-local/debian-minbase:$suite-$(base_key)"
  image="leasekeeper-local/debian:$suite-$(base_key)-$(trust_key)"
  if docker image inspect "$image" >/dev/null 2>&1; then
    echo "$image"
    return 0
  fi
  if ! docker image inspect "$bare" >/dev/null 2>&1; then
    docker import \
      --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'CMD ["bash"]' "$(base_tarball)" "$bare" >/dev/null
  fi
  ctx="$(mktemp -d)"
  mkdir "$ctx/local"
  cp "$ca_bundle" "$ctx/ca-certificates.crt"
  cp /usr/local/share/ca-certificates/*.crt "$ctx/local/" 2>/dev/null || true
  printf '%s\n' "FROM $bare" \
    "COPY local/ /usr/local/share/ca-certificates/" \
    "COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt" \
    "ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt PIP_CERT=/etc/ssl/certs/ca-certificates.crt" \
    >"$ctx/Dockerfile"
  if ! DOCKER_BUILDKIT=0 docker build -q --network host -t "$image" "$ctx" \
      >"$ctx/build.log" 2>&1; then
    cat "$ctx/build.log" >&2
    rm -rf "$ctx"
    exit 3
  fi
  rm -rf "$ctx"
  echo "$image"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  base-image) base_image ;;
  env) echo "export DOCKER_HOST=unix://$sock DOCKER_BUILDKIT=0" ;;
  *)
    echo "usage: $0 start|stop|base-image|env" >&2
    exit 2
    ;;
esac
