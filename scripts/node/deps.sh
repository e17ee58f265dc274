#!/usr/bin/env bash
# What a real kubelet node needs on this kind of machine (Debian bookworm): containerd 1.6, runc,
# a static busybox (the test images are built from it: there is no registry), the CNI plugins
# (/usr/lib/cni) and xz. Installs only what is missing; run as root.
set -euo pipefail
PACKAGES=(containerd runc busybox-static containernetworking-plugins xz-utils)
missing=()
for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
done
if ((${#missing[@]} == 0)); then
    echo "node-deps: installed (${PACKAGES[*]})"
    exit 0
fi
if [[ $(id -u) != 0 ]]; then
    echo "node-deps: FAILED: must run as root to install ${missing[*]}" >&2
    exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# Debian's containerd starts a system service, and at every boot, where an init system lets it:
# the tests run their own containerd in a work folder, so a containerd installed here is stopped
# and disabled again (one the host had before is left alone).
if [[ " ${missing[*]} " == *" containerd "* ]]; then
    "$(dirname "$0")/../service-off.sh" containerd
fi
echo "node-deps: installed ${missing[*]}"
