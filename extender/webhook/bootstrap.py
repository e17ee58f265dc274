"""Certificates without a manual step: a Secret shared by every replica, and the caBundle.

Each vramsched replica, at start-up: reads the Secret (namespace/name); if it is absent, or
its certificate does not cover the Service's names or expires within 30 days, it makes a new
CA + serving certificate and creates (or replaces, with the resourceVersion it read) the
Secret. Two replicas starting together race on create: the loser gets 409, reads the winner's
Secret and serves that, so both present the same certificate behind the Service. Then it
writes the CA into the caBundle of every webhook of the MutatingWebhookConfiguration (the
same value from every replica: idempotent). Renewal = delete the Secret and restart.
"""

from __future__ import annotations

import base64
import logging
from typing import Any

from extender.webhook.certs import ServingCert, cert_covers, make_serving_cert

__all__ = ["ensure_serving_cert", "patch_ca_bundle"]

log = logging.getLogger(__name__)


def _decode(secret: Any) -> ServingCert | None:
    data = secret.data or {}
    try:
        return ServingCert(
            base64.b64decode(data["tls.crt"]),
            base64.b64decode(data["tls.key"]),
            base64.b64decode(data["ca.crt"]),
        )
    except (KeyError, ValueError, TypeError):
        return None


def _body(
    namespace: str, name: str, cert: ServingCert, resource_version: str | None = None
) -> Any:  # a dict: the client takes one wherever its hints say V1Secret
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": {"app.kubernetes.io/name": "vramsched", "app.kubernetes.io/component": "webhook"},
    }
    if resource_version:
        meta["resourceVersion"] = resource_version
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": meta,
        "data": {
            "tls.crt": base64.b64encode(cert.cert_pem).decode(),
            "tls.key": base64.b64encode(cert.key_pem).decode(),
            "ca.crt": base64.b64encode(cert.ca_pem).decode(),
        },
    }


def ensure_serving_cert(
    client: Any, namespace: str, name: str, hosts: list[str], *, attempts: int = 5
) -> ServingCert:
    """The serving certificate every replica uses, created in the Secret if needed."""
    import kubernetes.client

    core = kubernetes.client.CoreV1Api(client)
    for _ in range(attempts):
        try:
            secret = core.read_namespaced_secret(name, namespace)
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:
                raise
            secret = None
        current = _decode(secret) if secret is not None else None
        if current is not None and cert_covers(current.cert_pem, hosts):
            return current
        fresh = make_serving_cert(hosts)
        try:
            if secret is None:
                core.create_namespaced_secret(namespace, _body(namespace, name, fresh))
                log.info(
                    "created webhook certificate secret %s/%s for %s",
                    namespace,
                    name,
                    ", ".join(hosts),
                )
            else:
                version = secret.metadata.resource_version if secret.metadata else None
                core.replace_namespaced_secret(
                    name, namespace, _body(namespace, name, fresh, version)
                )
                log.info("renewed webhook certificate secret %s/%s", namespace, name)
            return fresh
        except kubernetes.client.ApiException as exc:
            if exc.status != 409:
                raise
            # Another replica wrote it first: serve theirs.
    raise RuntimeError(
        f"secret {namespace}/{name} kept changing; gave up after {attempts} attempts"
    )


def patch_ca_bundle(client: Any, configuration: str, ca_pem: bytes) -> int:
    """Write the CA into every webhook of the MutatingWebhookConfiguration; returns how many
    were changed (0 when they already carried it)."""
    import kubernetes.client

    api = kubernetes.client.AdmissionregistrationV1Api(client)
    current = api.read_mutating_webhook_configuration(configuration)
    bundle = base64.b64encode(ca_pem).decode()
    ops: list[dict[str, Any]] = []
    for i, hook in enumerate(current.webhooks or []):
        have = hook.client_config.ca_bundle if hook.client_config else None
        if have == bundle:
            continue
        # "test" pins the index to the webhook read, against a concurrent reorder.
        ops.append({"op": "test", "path": f"/webhooks/{i}/name", "value": hook.name})
        ops.append({"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": bundle})
    if ops:
        api.patch_mutating_webhook_configuration(configuration, ops)
        log.info("wrote the webhook CA into %s (%d webhooks)", configuration, len(ops) // 2)
    return len(ops) // 2
