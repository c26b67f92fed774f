#!/usr/bin/env bash
# Install the Debian packages the test suite runs for real: redis-server and postgresql, and
# docker-compose, which checks docker-compose.yml offline (no Docker engine needed);
# prometheus (the server and promtool: the metrics and alert-rule tests) and chromium with
# chromium-driver (the console's browser test, headless).
set -euo pipefail
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || need+=(postgresql)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "missing Debian packages: ${need[*]}; install them (sudo apt-get install ${need[*]})" >&2
  exit 1
fi
echo "installing ${need[*]} from Debian"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# The packages start system services; the tests start their own servers on free ports.
for svc in redis-server postgresql prometheus prometheus-node-exporter; do
  if command -v systemctl >/dev/null 2>&1; then systemctl stop "$svc" >/dev/null 2>&1 || true; fi
done
