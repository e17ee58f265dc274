"""The Eviction API, the one write live repacking adds (`extender.live.repack`).

`POST /api/v1/namespaces/NS/pods/NAME/eviction`: the API server applies the PodDisruptionBudgets
that cover the pod (429 when one allows no disruption now) and then deletes it with its own
grace period; with `dryRun=All` it answers the same and changes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

from extender.live.api_client import KubeApi
from extender.repack_policy import eviction_api_version

__all__ = ["Evict", "KubeEvictions", "eviction_version"]

log = logging.getLogger(__name__)


class Evict(Protocol):
    """POST .../pods/NAME/eviction; raises `ApiError` (429: a PodDisruptionBudget refuses)."""

    def __call__(
        self, namespace: str, name: str, body: Mapping[str, Any], dry_run: bool
    ) -> None: ...


class KubeEvictions:
    """`Evict` through the live client (`extender.live.api_client.ClientApi`), with its write
    timeouts: an eviction is one more write of the same kind as a bind's."""

    def __init__(self, api: Any) -> None:
        self.api = api

    def __call__(self, namespace: str, name: str, body: Mapping[str, Any], dry_run: bool) -> None:
        self.api._json(
            "POST",
            f"/api/v1/namespaces/{namespace}/pods/{name}/eviction",
            body=dict(body),
            query={"dryRun": "All"} if dry_run else None,
            timeout=self.api.write_timeout,
        )


def eviction_version(api: KubeApi) -> str:
    """The Eviction's apiVersion for this API server (policy/v1 unless it is older than 1.22)."""
    try:
        return eviction_api_version(api.server_version())
    except Exception as exc:  # unreadable: the current version, which 1.22+ serves
        log.warning("cannot read the API server version for evictions: %s", exc)
        return "policy/v1"
