#!/usr/bin/env bash
# Stop a system service a Debian package just installed and keep it off at boot, where an init
# system runs one: the tests start their own etcd, containerd and Prometheus in work folders,
# and a package's own service would hold their ports and outlive `make test`. Never fails.
# Usage: scripts/service-off.sh NAME
name="${1:?usage: service-off.sh NAME}"
service "$name" stop >/dev/null 2>&1 || true
systemctl disable "$name" >/dev/null 2>&1 || update-rc.d "$name" disable >/dev/null 2>&1 || true
