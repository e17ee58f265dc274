#!/usr/bin/env bash
# Build the real Kubernetes control plane that vramsched's e2e tests run on loopback.
#
# Why a build: only Debian bookworm's `kubernetes` SOURCE package carries kube-apiserver and
# kube-scheduler (v1.20.2, with vendor/); no binary package or download is reachable here.
# Facts behind each step (docs/control-plane.md explains them): the source is Debian bookworm's
# `kubernetes` package (https://packages.debian.org/source/bookworm/kubernetes); the vendored
# reflect2 1.0.1 crashes on Go >= 1.18 (https://github.com/modern-go/reflect2/issues/24, fixed in
# v1.0.2); the openapi and version steps follow upstream v1.20.2's build/root/Makefile.generated_files
# and hack/lib/version.sh (https://github.com/kubernetes/kubernetes/tree/v1.20.2).
#
# Idempotent and non-interactive; run as root. Installs what is missing (golang-go, etcd-server,
# reflect2 1.0.2, dpkg-dev, openssl, kubectl), fetches the source, builds, and caches the
# binaries OUTSIDE the repo in ${VRAMSCHED_CACHE:-$HOME/.cache/vramsched}/k8s-1.20.2/bin/.
# With the binaries cached and the packages installed it exits at once.
#
# Usage: scripts/control-plane/build.sh [--force]   (--force rebuilds the binaries)
# Prints one result line; everything else goes to <cache>/k8s-1.20.2/build.log.
set -euo pipefail

K8S_VERSION=1.20.2
CACHE_ROOT="${VRAMSCHED_CACHE:-${HOME:-/root}/.cache/vramsched}"
K8S_DIR="$CACHE_ROOT/k8s-$K8S_VERSION"
BIN_DIR="$K8S_DIR/bin"
LOG="$K8S_DIR/build.log"
FORCE=0
[[ "${1:-}" == "--force" ]] && FORCE=1

# Debian packages -> a file or command that proves each is there.
PACKAGES=(golang-go etcd-server golang-github-modern-go-reflect2-dev dpkg-dev openssl)
REFLECT2_DEB=/usr/share/gocode/src/github.com/modern-go/reflect2

missing_packages() {
    local pkg missing=()
    for pkg in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' \
            || missing+=("$pkg")
    done
    command -v kubectl >/dev/null 2>&1 || missing+=(kubernetes-client)
    echo "${missing[@]:-}"
}

binaries_cached() {
    [[ -x "$BIN_DIR/kube-apiserver" && -x "$BIN_DIR/kube-scheduler" ]]
}

# ---- fast path: nothing to do --------------------------------------------------------------
if [[ $FORCE == 0 ]] && binaries_cached && [[ -z "$(missing_packages)" ]]; then
    echo "control-plane: cached kube-apiserver/kube-scheduler v$K8S_VERSION in $BIN_DIR"
    exit 0
fi

if [[ $(id -u) != 0 ]]; then
    echo "control-plane: FAILED: must run as root (apt-get install)" >&2
    exit 1
fi

mkdir -p "$K8S_DIR"
START=$(date +%s)
# fds 7/8 keep the terminal for the result line; children never see them (debconf writes to fd 3).
exec 7>&1 8>&2
exec >>"$LOG" 2>&1
echo "=== build.sh started $(date -u +%FT%TZ) (force=$FORCE) ==="
trap 'rc=$?; if [[ $rc != 0 ]]; then echo "control-plane: FAILED (exit $rc) after $(( $(date +%s) - START ))s; log: $LOG" >&8; tail -n 30 "$LOG" | sed "s/^/  | /" >&8; fi' EXIT

trap 'echo "error: line $LINENO: $BASH_COMMAND"' ERR

# Serialise concurrent builds (several pytest sessions may start at once).
exec 9>"$K8S_DIR/.lock"
flock 9
if [[ $FORCE == 0 ]] && binaries_cached && [[ -z "$(missing_packages)" ]]; then
    echo "another build finished while we waited for the lock"
    echo "control-plane: cached kube-apiserver/kube-scheduler v$K8S_VERSION in $BIN_DIR (built concurrently)" >&7
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
APT_UPDATED=0
retry() {  # a registry hiccup should not fail a CI run
    local attempt
    for attempt in 1 2 3; do
        "$@" 7>&- 8>&- 9>&- && return 0
        echo "attempt $attempt failed: $*"
        sleep $((attempt * 5))
    done
    return 1
}
apt_update_once() {
    if [[ $APT_UPDATED == 0 ]]; then
        retry apt-get update -q
        APT_UPDATED=1
    fi
}

# ---- 1. packages ---------------------------------------------------------------------------
MISSING="$(missing_packages)"
if [[ -n "$MISSING" ]]; then
    echo "installing: $MISSING"
    apt_update_once
    # shellcheck disable=SC2086
    retry apt-get install -y -q --no-install-recommends $MISSING
    # Debian's etcd-server starts a system etcd, and at every boot, where an init system lets it:
    # the tests run their own on ports of their own, so one installed here is stopped and disabled.
    if [[ " $MISSING " == *" etcd-server "* ]]; then
        "$(dirname "$0")/../service-off.sh" etcd
    fi
fi

# ---- 2. source -----------------------------------------------------------------------------
SRC_PARENT="$K8S_DIR/src"
find_src() {
    [[ -d "$SRC_PARENT" ]] || return 0
    find "$SRC_PARENT" -mindepth 1 -maxdepth 1 -type d -name 'kubernetes-*' | head -n1
}
SRC="$(find_src)"
if [[ -z "$SRC" || ! -f "$SRC/.vramsched-prepared" ]]; then
    rm -rf "$SRC_PARENT"
    # apt-get source needs a deb-src entry for bookworm: mirror the binary entries.
    SRC_LIST=""
    if ! apt-cache showsrc kubernetes 2>/dev/null | grep -q '^Version: .*really1\.20\.2'; then
        SRC_LIST=/etc/apt/sources.list.d/vramsched-deb-src.sources
        if [[ -f /etc/apt/sources.list.d/debian.sources ]] \
            && grep -q '^Types: deb$' /etc/apt/sources.list.d/debian.sources; then
            sed 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources >"$SRC_LIST"
        else
            cat >"$SRC_LIST" <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
        fi
        echo "added $SRC_LIST"
        APT_UPDATED=0
        apt_update_once
    fi
    TMP_SRC="$K8S_DIR/src.tmp"
    rm -rf "$TMP_SRC" && mkdir -p "$TMP_SRC"
    got=0
    (cd "$TMP_SRC" && retry apt-get source -q kubernetes) || got=$?
    # the deb-src entry was for this one download: take it off the host again
    if [[ -n "$SRC_LIST" ]]; then
        rm -f "$SRC_LIST"
        echo "removed $SRC_LIST"
    fi
    ((got == 0)) || exit "$got"
    SRC_NAME="$(cd "$TMP_SRC" && find . -mindepth 1 -maxdepth 1 -type d -name 'kubernetes-*' | head -n1)"
    [[ -n "$SRC_NAME" && -d "$TMP_SRC/$SRC_NAME/vendor/k8s.io" && -d "$TMP_SRC/$SRC_NAME/cmd/kube-apiserver" ]] \
        || { echo "apt-get source kubernetes gave no full tree with vendor/ (need bookworm's 1.20.2)"; exit 1; }
    rm -f "$TMP_SRC"/*.tar.* "$TMP_SRC"/*.dsc
    W="$TMP_SRC/$SRC_NAME"

    # reflect2 1.0.1 (vendored) crashes at run time on Go >= 1.18: use Debian's 1.0.2.
    find "$W/vendor/github.com/modern-go/reflect2" -maxdepth 1 -type f \( -name '*.go' -o -name '*.s' \) -delete
    cp "$REFLECT2_DEB"/*.go "$REFLECT2_DEB"/*.s "$W/vendor/github.com/modern-go/reflect2/"
    touch "$W/.vramsched-prepared"
    mkdir -p "$SRC_PARENT"
    mv "$W" "$SRC_PARENT/"
    rm -rf "$TMP_SRC"
    SRC="$(find_src)"
fi
echo "source: $SRC ($(( $(date +%s) - START ))s)"

# ---- 3. Go environment: GOPATH mode, like upstream 1.20 ------------------------------------
export GOPATH="$K8S_DIR/gopath"
export GOCACHE="$K8S_DIR/gocache"
export GO111MODULE=off CGO_ENABLED=0 GOFLAGS=
mkdir -p "$GOPATH/src/k8s.io" "$GOCACHE"
ln -sfn "$SRC" "$GOPATH/src/k8s.io/kubernetes"
cd "$GOPATH/src/k8s.io/kubernetes"    # logical path, so `go` sees the k8s.io/kubernetes import path
go version

# ---- 4. openapi: pkg/generated/openapi/zz_generated.openapi.go is not in the tarball ------
OPENAPI_OUT=pkg/generated/openapi/zz_generated.openapi.go
if [[ ! -s "$OPENAPI_OUT" ]]; then
    nice -n 10 go build -o "$K8S_DIR/tools/openapi-gen" ./vendor/k8s.io/kube-openapi/cmd/openapi-gen
    # Same input set as build/root/Makefile.generated_files (KUBE target): every package with a
    # `+k8s:openapi-gen=` tag, staging named as vendor/, minus code-generator and sample-apiserver.
    DIRS="$(find -H . \( -path './_*' -o -path './.*' -o -path ./vendor -o -path ./debian \) -prune \
                -o -type f -name '*.go' -print \
            | xargs grep --color=never -l '^// *+k8s:' \
            | xargs grep --color=never -l '+k8s:openapi-gen=' \
            | sed -e 's|^\./staging/src|vendor|' -e 's|^\./||' \
            | xargs -n1 dirname \
            | grep -v -E '^vendor/k8s\.io/(code-generator|sample-apiserver)/' \
            | LC_ALL=C sort -u | sed 's|^|k8s.io/kubernetes/|' | paste -sd, -)"
    echo "openapi-gen over $(tr ',' '\n' <<<"$DIRS" | wc -l) packages"
    nice -n 10 "$K8S_DIR/tools/openapi-gen" --logtostderr \
        -i "$DIRS" \
        -p k8s.io/kubernetes/pkg/generated/openapi \
        -O zz_generated.openapi \
        -o "$GOPATH/src" \
        -h vendor/k8s.io/code-generator/hack/boilerplate.go.txt \
        -r "$K8S_DIR/openapi-violations.report"
    [[ -s "$OPENAPI_OUT" ]] || { echo "openapi-gen wrote no $OPENAPI_OUT"; exit 1; }
fi

# ---- 5. build ------------------------------------------------------------------------------
# Version stamps, as hack/lib/version.sh sets them (else /version says v0.0.0-master).
LDFLAGS="-s -w"
BUILD_DATE="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
for pkg in client-go/pkg/version component-base/version; do
    V="k8s.io/kubernetes/vendor/k8s.io/$pkg"
    LDFLAGS+=" -X $V.gitMajor=1 -X $V.gitMinor=20 -X $V.gitVersion=v$K8S_VERSION"
    LDFLAGS+=" -X $V.gitTreeState=clean -X $V.buildDate=$BUILD_DATE"
done
OUT_TMP="$K8S_DIR/bin.tmp"
rm -rf "$OUT_TMP" && mkdir -p "$OUT_TMP"
echo "go build kube-apiserver kube-scheduler ($(( $(date +%s) - START ))s)"
nice -n 10 go build -ldflags "$LDFLAGS" -o "$OUT_TMP/" ./cmd/kube-apiserver ./cmd/kube-scheduler
"$OUT_TMP/kube-apiserver" --version
"$OUT_TMP/kube-scheduler" --version
mkdir -p "$BIN_DIR"
mv -f "$OUT_TMP/kube-apiserver" "$OUT_TMP/kube-scheduler" "$BIN_DIR/"
rm -rf "$OUT_TMP"

ELAPSED=$(( $(date +%s) - START ))
echo "=== build.sh done in ${ELAPSED}s ==="
echo "control-plane: built kube-apiserver/kube-scheduler v$K8S_VERSION in ${ELAPSED}s -> $BIN_DIR (etcd: $(command -v etcd))" >&7
