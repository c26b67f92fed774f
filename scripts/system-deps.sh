#!/usr/bin/env bash
# Install the Debian packages the test suite runs for real: redis-server and postgresql
# (and pgbouncer in front of it: the store behind a pooler);
# docker-compose (it parses docker-compose.yml and drives the compose tests); docker.io
# (Debian's dockerd, which scripts/dockerd.sh starts privately: no bridge, no iptables) and
# debootstrap (the registry-free base image); prometheus (the server and promtool: the
# metrics and alert-rule tests) and chromium with chromium-driver (the console's browser
# test, headless); util-linux's unshare (the kubelet simulator's ServiceAccount pods);
# busybox (the pool claim's delivery script runs under Alpine's shell and tools too).
set -euo pipefail
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || need+=(postgresql)
[ -x /usr/sbin/pgbouncer ] || need+=(pgbouncer)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
command -v unshare >/dev/null 2>&1 || need+=(util-linux)
command -v busybox >/dev/null 2>&1 || need+=(busybox)
[ -x /usr/sbin/dockerd ] || need+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || need+=(debootstrap)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "missing Debian packages: ${need[*]}; install them (sudo apt-get install ${need[*]})" >&2
  exit 1
fi
echo "installing ${need[*]} from Debian"
export DEBIAN_FRONTEND=noninteractive
# The packages would start system services (a system dockerd would create its docker0
# bridge): forbid that for the install; the tests start their own servers.
policy=/usr/sbin/policy-rc.d
own_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && own_policy=1
fi
trap '[ "$own_policy" = 1 ] && rm -f "$policy"' EXIT
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
for svc in redis-server postgresql pgbouncer prometheus prometheus-node-exporter docker.socket docker containerd; do
  if command -v systemctl >/dev/null 2>&1; then systemctl stop "$svc" >/dev/null 2>&1 || true; fi
done
