"""The webhook's HTTPS listener: POST /mutate (AdmissionReview), GET /healthz. Nothing else.

Its own aiohttp application on its own port, apart from the extender's verbs: kube-apiserver
must reach it over the pod network, the verbs stay on loopback.
"""

from __future__ import annotations

import logging
import os
import ssl
import tempfile
from typing import Any

import orjson
from aiohttp import web

from extender.webhook.admission import LargestDevice, ReviewError, review
from extender.webhook.certs import ServingCert

__all__ = ["create_webhook_app", "ssl_context", "MAX_REVIEW_BYTES", "MUTATE_PATH"]

log = logging.getLogger(__name__)

MUTATE_PATH = "/mutate"
# A Pod with its managed fields is a few tens of KiB; kube-apiserver caps requests at 3 MiB.
MAX_REVIEW_BYTES = 4 * 1024 * 1024
_SETTINGS = web.AppKey("webhook", dict)


def _error(status: int, message: str) -> web.Response:
    return web.Response(
        body=orjson.dumps({"Error": message}), status=status, content_type="application/json"
    )


async def _mutate(request: web.Request) -> web.Response:
    settings: dict[str, Any] = request.app[_SETTINGS]
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return _error(400, f"body is not valid JSON: {exc}")
    try:
        answer = review(body, **settings)
    except ReviewError as exc:
        return _error(400, str(exc))
    except Exception:  # a bug must not fail pod creation (failurePolicy: Ignore)
        log.exception("admission review failed")
        return _error(500, "internal error in vramsched's webhook (see its log)")
    response = answer["response"]
    if not response["allowed"] or response.get("warnings"):
        log.info(
            "admission",
            extra={
                "fields": {
                    "uid": response["uid"],
                    "allowed": response["allowed"],
                    "message": (response.get("status") or {}).get("message", ""),
                    "warnings": response.get("warnings", []),
                }
            },
        )
    return web.Response(body=orjson.dumps(answer), content_type="application/json")


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def create_webhook_app(
    *, scheduler_name: str = "vramsched", largest_device: LargestDevice | None = None
) -> web.Application:
    app = web.Application(client_max_size=MAX_REVIEW_BYTES)
    app[_SETTINGS] = {"scheduler_name": scheduler_name, "largest_device": largest_device}
    app.router.add_post(MUTATE_PATH, _mutate)
    app.router.add_get("/healthz", _healthz)
    return app


def ssl_context(
    *, cert_file: str | None = None, key_file: str | None = None, cert: ServingCert | None = None
) -> ssl.SSLContext:
    """A server context from files, or from an in-memory certificate (written to a private
    temporary file only for the moment ssl needs a path)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert is None:
        ctx.load_cert_chain(cert_file or "", key_file)
        return ctx
    fd, path = tempfile.mkstemp(prefix="vramsched-webhook-", suffix=".pem")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cert.cert_pem + cert.key_pem)
        ctx.load_cert_chain(path)
    finally:
        os.unlink(path)
    return ctx
