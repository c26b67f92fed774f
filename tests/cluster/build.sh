#!/usr/bin/env bash
# tests/cluster/build.sh — owns building and caching kube-apiserver and kube-controller-manager
# for the test cluster harness, from Debian's `kubernetes` source package (its orig tarball is the
# whole upstream 1.20 tree with vendor/). Idempotent and non-interactive; run as root on Debian
# bookworm. When the cached binaries exist it only prints their directory. Last line of output is
# always the bin directory.
set -euo pipefail

PINNED_VERSION="${LEASEKEEPER_KUBE_SRC_VERSION:-1.20.5+really1.20.2-1.1+deb12u1}"
CACHE_ROOT="${LEASEKEEPER_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/leasekeeper}"
BINARIES=(kube-apiserver kube-controller-manager)

have_binaries() {
  local dir="$1" b
  for b in "${BINARIES[@]}"; do [[ -x "$dir/$b" ]] || return 1; done
}

# Fast path: the pinned version, or the version recorded by the last successful build.
for candidate in "$CACHE_ROOT/kube-$PINNED_VERSION" \
                 "$CACHE_ROOT/kube-$(cat "$CACHE_ROOT/latest" 2>/dev/null || echo none)"; do
  if have_binaries "$candidate"; then
    echo "$candidate"
    exit 0
  fi
done

log() { echo "build.sh: $*" >&2; }
SUDO=""
if [[ "$(id -u)" != 0 ]]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive

# 1. deb-src for bookworm main (a separate deb822 file; the existing debian.sources is untouched).
SRC_FILE=/etc/apt/sources.list.d/leasekeeper-deb-src.sources
if ! grep -rqsE '^(Types:.*deb-src|deb-src )' /etc/apt/sources.list /etc/apt/sources.list.d/; then
  log "adding $SRC_FILE"
  $SUDO tee "$SRC_FILE" >/dev/null <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
fi

# 2. Tools (installed only when missing).
PKGS=(golang-1.19 rsync jq make etcd-server golang-github-modern-go-reflect2-dev openssl)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
log "apt-get update"
$SUDO apt-get update -qq >&2
if ((${#missing[@]})); then
  log "installing ${missing[*]}"
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

# 3. Source version actually available (normally the pinned one).
VERSION="$(apt-cache showsrc kubernetes | awk '/^Version:/ {print $2}' | sort -V | tail -1)"
if [[ -z "$VERSION" ]]; then
  log "error: apt-cache showsrc kubernetes found no source package (deb-src missing?)"
  exit 1
fi
[[ "$VERSION" == "$PINNED_VERSION" ]] || log "warning: source version $VERSION, pinned $PINNED_VERSION"
BIN_DIR="$CACHE_ROOT/kube-$VERSION"
if have_binaries "$BIN_DIR"; then
  echo "$VERSION" >"$CACHE_ROOT/latest"
  echo "$BIN_DIR"
  exit 0
fi

# 4. Download and build in a temporary directory outside the work tree.
WORK="$(mktemp -d "${TMPDIR:-/tmp}/leasekeeper-kube-build.XXXXXX")"
trap 'chmod -R u+w "$WORK" 2>/dev/null || true; rm -rf "$WORK"' EXIT
cd "$WORK"
log "downloading kubernetes source $VERSION into $WORK"
apt-get source --download-only "kubernetes=$VERSION" >&2
ORIG="$(ls kubernetes_*.orig.tar.* | head -1)"
mkdir src
tar -xf "$ORIG" -C src --strip-components=1
cd src
[[ -d cmd/kube-apiserver && -d vendor ]] || { log "error: $ORIG lacks cmd/kube-apiserver or vendor/"; exit 1; }

REFLECT2=/usr/share/gocode/src/github.com/modern-go/reflect2
[[ -d "$REFLECT2" ]] || { log "error: $REFLECT2 missing"; exit 1; }
rm -rf vendor/github.com/modern-go/reflect2
cp -r "$REFLECT2" vendor/github.com/modern-go/reflect2

UPSTREAM="${VERSION%-*}"          # strip the Debian revision
UPSTREAM="${UPSTREAM##*really}"   # 1.20.5+really1.20.2 -> 1.20.2
export PATH="/usr/lib/go-1.19/bin:$PATH"
export KUBE_GIT_VERSION="v$UPSTREAM" KUBE_GIT_TREE_STATE=clean
export GOFLAGS="" GO111MODULE=off GOCACHE="$WORK/gocache" GOPATH="$WORK/gopath"
log "building kube-apiserver and kube-controller-manager $KUBE_GIT_VERSION (takes ~6 minutes)"
start=$(date +%s)
make WHAT="cmd/kube-apiserver cmd/kube-controller-manager" >&2
log "build took $(( $(date +%s) - start )) s"

mkdir -p "$BIN_DIR.tmp"
for b in "${BINARIES[@]}"; do cp "_output/bin/$b" "$BIN_DIR.tmp/$b"; done
rm -rf "$BIN_DIR"
mv "$BIN_DIR.tmp" "$BIN_DIR"
echo "$VERSION" >"$CACHE_ROOT/latest"
echo "$BIN_DIR"
