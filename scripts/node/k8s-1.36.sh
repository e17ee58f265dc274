#!/usr/bin/env bash
# Kubernetes v1.36.3 binaries (kube-apiserver, kube-scheduler, kube-controller-manager, kubelet)
# for the kubelet e2e tests: unpacked from the xz files of the shared k8s-1.36 folder, checked
# against its SHA256SUMS, cached OUTSIDE the repo in
# ${VRAMSCHED_CACHE:-$HOME/.cache/vramsched}/k8s-1.36.3/bin/. A kubelet may not be newer than its
# API server, hence a whole 1.36 control plane beside the 1.20 one the other e2e tests use.
#
# The folder: $VRAMSCHED_K8S_136 (default: the repository's sibling ../shared/k8s-1.36).
# Idempotent: with every binary cached and matching its sum it exits at once.
set -euo pipefail

VERSION=1.36.3
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SRC="${VRAMSCHED_K8S_136:-$REPO/../shared/k8s-1.36}"
CACHE_ROOT="${VRAMSCHED_CACHE:-${HOME:-/root}/.cache/vramsched}"
DIR="$CACHE_ROOT/k8s-$VERSION"
BIN="$DIR/bin"
NAMES=(kube-apiserver kube-scheduler kube-controller-manager kubelet)

cached() {
    [[ -f "$SRC/SHA256SUMS" ]] || return 1
    (cd "$BIN" 2>/dev/null && grep -E "  ($(IFS='|'; echo "${NAMES[*]}"))\$" "$SRC/SHA256SUMS" \
        | sha256sum --quiet -c - >/dev/null 2>&1)
}

if [[ ! -f "$SRC/SHA256SUMS" ]]; then
    if [[ -x "$BIN/kubelet" && -x "$BIN/kube-apiserver" ]]; then
        echo "k8s-$VERSION: $SRC missing; using the cached binaries in $BIN"
        exit 0
    fi
    echo "k8s-$VERSION: FAILED: no $SRC/SHA256SUMS (set VRAMSCHED_K8S_136 to the folder with the" \
         "kube-*.xz and kubelet.xz files)" >&2
    exit 1
fi
mkdir -p "$BIN"
exec 9>"$DIR/.lock"
flock 9
if cached; then
    echo "k8s-$VERSION: cached in $BIN"
    exit 0
fi
for name in "${NAMES[@]}"; do
    want="$(awk -v n="$name" '$2 == n {print $1}' "$SRC/SHA256SUMS")"
    [[ -n "$want" ]] || { echo "k8s-$VERSION: FAILED: $name not in SHA256SUMS" >&2; exit 1; }
    if [[ -x "$BIN/$name" ]] && [[ "$(sha256sum "$BIN/$name" | cut -d' ' -f1)" == "$want" ]]; then
        continue
    fi
    xz -dc "$SRC/$name.xz" > "$BIN/.$name.tmp"
    got="$(sha256sum "$BIN/.$name.tmp" | cut -d' ' -f1)"
    if [[ "$got" != "$want" ]]; then
        rm -f "$BIN/.$name.tmp"
        echo "k8s-$VERSION: FAILED: $name sha256 $got, SHA256SUMS says $want" >&2
        exit 1
    fi
    chmod +x "$BIN/.$name.tmp"
    mv "$BIN/.$name.tmp" "$BIN/$name"
done
echo "k8s-$VERSION: unpacked into $BIN"
