"""What live mode adapts to the control plane's Kubernetes version."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["needs_legacy_failed_nodes"]


def needs_legacy_failed_nodes(version: Mapping[str, Any] | None) -> bool:
    """Whether a control plane of this `/version` needs unresolvable nodes in FailedNodes too:
    kube-scheduler < 1.21 reads no other map. kube-scheduler runs the control plane's version
    (within one minor); an unreadable version keeps them (harmless, only larger answers)."""
    try:
        major = int(re.sub(r"\D.*", "", str((version or {}).get("major", ""))))
        minor = int(re.sub(r"\D.*", "", str((version or {}).get("minor", ""))))
    except ValueError:
        return True
    return (major, minor) < (1, 21)
