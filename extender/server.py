"""aiohttp routes: decode the body, call the service, encode the answer. Nothing else.

kube-scheduler treats any non-200 answer as an extender error, so malformed requests get
a 4xx with an `Error` key (readable by both people and the scheduler's decoder), and
problems with a well-formed request (a bad annotation) get 200 with `Error` set.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson
from aiohttp import web
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticSerializationError

from extender.demand import DemandError
from extender.metrics import Metrics
from extender.namelists import NameLists
from extender.observe.collector import HealthCollector
from extender.observe.gpu_metrics import GpuExposition
from extender.placement import SharedReasons
from extender.service import Extender
from extender.wire import (
    VERBS,
    ExtenderArgs,
    ExtenderBindingArgs,
    ExtenderFilterResult,
    ExtenderPreemptionArgs,
    HostPriorityList,
    HostTables,
    ScoredHosts,
)

__all__ = [
    "create_app",
    "create_probe_app",
    "start_site",
    "route_paths",
    "decode_args",
    "encode_names_result",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_CONCURRENCY",
    "SERVICE_KEY",
    "METRICS_KEY",
]

log = logging.getLogger(__name__)

# 5,000 full Node objects with managedFields are ~25-50 MiB when nodeCacheCapable=false.
DEFAULT_MAX_BODY_BYTES = 128 * 1024 * 1024
# Requests in flight at once; with the body limit it bounds the memory a flood can pin
# (256 x a few KiB in normal use). kube-scheduler itself sends a few at a time.
DEFAULT_MAX_CONCURRENCY = 256
SERVICE_KEY = web.AppKey("service", Extender)
METRICS_KEY = web.AppKey("metrics", Metrics)
NAMES_KEY = web.AppKey("names", NameLists)
HOSTS_KEY = web.AppKey("hosts", HostTables)
#: says whether the source is synced, and what it knows (`/readyz`)
READY_KEY = web.AppKey[Callable[[], tuple[bool, dict[str, Any]]]]("ready")

M = TypeVar("M", bound=BaseModel)

_JSON = "application/json"
_EXPOSITION = "text/plain; version=0.0.4; charset=utf-8"
_GET_PATHS = ("/healthz", "/readyz", "/metrics", "/state", "/openapi.yaml")


_DELETE_PATH = "/pods/{namespace}/{name}"


def route_paths() -> set[str]:
    """Every path the server answers; the deploy tests check the scheduler config against it."""
    return {f"/{v}" for v in VERBS} | set(_GET_PATHS) | {_DELETE_PATH}


def _json(body: Any, status: int = 200) -> web.Response:
    data = (
        body.__pydantic_serializer__.to_json(body)
        if isinstance(body, BaseModel)
        else orjson.dumps(body)
    )
    return web.Response(body=data, status=status, content_type=_JSON)


def _error(status: int, message: str) -> web.Response:
    return web.Response(body=orjson.dumps({"Error": message}), status=status, content_type=_JSON)


def _validation_message(model: type[BaseModel], exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False)[:3]:
        loc = ".".join(str(x) for x in err.get("loc", ())) or "body"
        parts.append(f"{loc}: {err.get('msg')}")
    more = f" (+{exc.error_count() - 3} more)" if exc.error_count() > 3 else ""
    return f"invalid {model.__name__}: " + "; ".join(parts) + more


async def _decode(request: web.Request, model: type[M]) -> M:
    return _validate(model, _parse(model, await request.read()))


def _parse(model: type[BaseModel], raw: bytes) -> dict[str, Any]:
    if not raw:
        raise web.HTTPBadRequest(text=f"empty body: expected {model.__name__} JSON")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise web.HTTPBadRequest(text=f"body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise web.HTTPBadRequest(
            text=f"body must be a JSON object ({model.__name__}), got {type(obj).__name__}"
        )
    return obj


def _validate(model: type[M], obj: dict[str, Any]) -> M:
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise web.HTTPBadRequest(text=_validation_message(model, exc)) from None


async def _decode_args(request: web.Request, *, learn: bool) -> ExtenderArgs:
    return decode_args(await request.read(), request.app[NAMES_KEY], learn=learn)


def decode_args(raw: bytes, lists: NameLists, *, learn: bool) -> ExtenderArgs:
    """ExtenderArgs, with a candidate list seen before taken from `lists` instead of decoded and
    validated again; with `learn`, a new list is remembered (filter's all-nodes list).
    Raises HTTPBadRequest naming what is wrong."""
    hit = lists.split(raw)
    if hit is not None:
        head, names = hit
        args = _validate(ExtenderArgs, head)
        args.NodeNames = names
        return args
    args = _validate(ExtenderArgs, _parse(ExtenderArgs, raw))
    if learn and args.NodeNames:
        lists.remember(args.NodeNames, raw=raw)
    return args


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _timed(verb: str, handler: Handler) -> Handler:
    async def wrapped(request: web.Request) -> web.StreamResponse:
        metrics = request.app[METRICS_KEY]
        start = time.perf_counter()
        code = 500
        try:
            response = await handler(request)
            code = response.status
            return response
        except web.HTTPException as exc:
            code = exc.status
            raise
        finally:
            metrics.request(verb, code, time.perf_counter() - start)

    return wrapped


async def _filter(request: web.Request) -> web.Response:
    args = await _decode_args(request, learn=True)
    result = request.app[SERVICE_KEY].filter(args)
    if not result.Error and result.Nodes is None:
        return web.Response(
            body=encode_names_result(result, request.app[NAMES_KEY]), content_type=_JSON
        )
    if not result.Error:
        try:
            return _json(result)
        except (
            PydanticSerializationError
        ):  # full Nodes are echoed back; JSON encoders stop at ~250 levels
            result = ExtenderFilterResult(
                Error="a Node in the request is nested too deeply to send back"
            )
    request.app[METRICS_KEY].errors.labels("filter").inc()
    return _json(result)


def encode_names_result(result: ExtenderFilterResult, lists: NameLists) -> bytes:
    """A filter answer in the NodeNames form (nodeCacheCapable): plain lists and dicts of str,
    which orjson writes ~5x faster than the model's serializer. The list is encoded apart and
    remembered in `lists`: prioritize is about to send it back. Its names are a subset of the
    request's NodeNames (validated: at most 253 characters each), so their lengths are not checked again."""
    feasible = result.NodeNames
    encoded = lists.remember(feasible, short_names=True) if feasible is not None else None
    return b"".join(
        (
            b'{"Nodes":null,"NodeNames":',
            encoded if encoded is not None else orjson.dumps(feasible),
            b',"FailedNodes":',
            orjson.dumps(result.FailedNodes),
            b',"FailedAndUnresolvableNodes":',
            _encode_reasons(result.FailedAndUnresolvableNodes),
            b',"Error":""}',
        )
    )


def _encode_reasons(reasons: dict[str, str]) -> bytes:
    """Reasons shared between answers (read-only) are encoded once and kept with them."""
    if isinstance(reasons, SharedReasons):
        if reasons.encoded is None:
            reasons.encoded = orjson.dumps(reasons)
        return reasons.encoded
    return orjson.dumps(reasons)


async def _prioritize(request: web.Request) -> web.Response:
    args = await _decode_args(request, learn=False)
    hosts = request.app[SERVICE_KEY].prioritize(args)
    if isinstance(hosts, ScoredHosts):  # the hot path: encoded from arrays, no object per host
        return web.Response(body=hosts.to_json(request.app[HOSTS_KEY]), content_type=_JSON)
    return _json(HostPriorityList(list(hosts)))


async def _bind(request: web.Request) -> web.Response:
    args = await _decode(request, ExtenderBindingArgs)
    result = await request.app[SERVICE_KEY].bind(args)
    if result.Error:
        request.app[METRICS_KEY].errors.labels("bind").inc()
    return _json(result)


async def _preempt(request: web.Request) -> web.Response:
    args = await _decode(request, ExtenderPreemptionArgs)
    try:
        return _json(request.app[SERVICE_KEY].preempt(args))
    except DemandError as exc:
        raise web.HTTPBadRequest(text=str(exc)) from None


_DELETE_STATUS = {"unknown": 404, "binding": 409, "live": 405}


async def _delete_pod(request: web.Request) -> web.Response:
    refused = request.app[SERVICE_KEY].delete_pod(
        request.match_info["namespace"], request.match_info["name"]
    )
    if refused is None:
        return _json({"Error": ""})
    kind, message = refused
    response = _error(_DELETE_STATUS[kind], message)
    if kind == "live":
        response.headers["Allow"] = ""  # RFC 9110: an empty Allow says no method is allowed here
    return response


async def _unknown_verb(request: web.Request) -> web.Response:
    verb = request.match_info.get("verb", "")
    return _error(404, f"unknown verb {verb[:64]!r}: expected one of {', '.join(VERBS)}")


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _readyz(request: web.Request) -> web.Response:
    ready, detail = request.app[READY_KEY]()
    return _json({"ready": ready, **detail}, status=200 if ready else 503)


async def _metrics(request: web.Request) -> web.StreamResponse:
    """Streamed piece by piece, other requests served in between: the per-GPU families of a large
    cluster are tens of MB. Gzipped when the scraper accepts it (Prometheus does), at level 1 in
    the default executor, off the loop (zlib lets other threads run while it compresses): about a
    quarter of the CPU of zlib's default level, for a third more bytes."""
    gzip = "gzip" in request.headers.get("Accept-Encoding", "")
    headers = {"Content-Type": _EXPOSITION}
    if gzip:
        headers["Content-Encoding"] = "gzip"
    response = web.StreamResponse(headers=headers)
    await response.prepare(request)
    z = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS) if gzip else None
    loop = asyncio.get_running_loop()
    for piece in request.app[METRICS_KEY].pieces():
        if piece:
            data = await loop.run_in_executor(None, z.compress, piece) if z else piece
            if data:
                await response.write(data)
        await asyncio.sleep(0)
    if z is not None:
        await response.write(z.flush())
    await response.write_eof()
    return response


async def _state(request: web.Request) -> web.Response:
    return _json(request.app[SERVICE_KEY].state())


async def _openapi(request: web.Request) -> web.Response:
    from importlib.resources import files

    return web.Response(
        body=files("extender").joinpath("openapi.yaml").read_bytes(),
        content_type="application/yaml",
    )


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves as JSON with `Error`; nothing escapes and stops the server."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
        response = _error(exc.status, message or exc.reason)
        if "Allow" in exc.headers:  # a 405 must say what is allowed (RFC 9110)
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except Exception:  # the server must keep serving
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _error(500, "internal error in vramsched (see its log)")


# Probes must answer under load, or the kubelet would restart a busy extender.
_UNLIMITED_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


def _concurrency_limit(limit: int) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Refuse (503, `Error`, Retry-After) beyond `limit` requests in flight instead of queueing without bound."""
    in_flight = 0

    @web.middleware
    async def limit_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        nonlocal in_flight
        if request.path in _UNLIMITED_PATHS:
            return await handler(request)
        if in_flight >= limit:
            response = _error(
                503, f"vramsched is busy: more than {limit} requests in flight; retry"
            )
            response.headers["Retry-After"] = "1"
            return response
        in_flight += 1
        try:
            return await handler(request)
        finally:
            in_flight -= 1

    return limit_middleware


async def start_site(site: web.TCPSite, flags: str, host: str, port: int) -> None:
    """Start a listener; an address that cannot be had (no such host, the port taken) stops the
    command with one line naming the flags, not a traceback."""
    try:
        await site.start()
    except OSError as exc:
        raise SystemExit(
            f"{flags}: cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from None


def create_probe_app(main: web.Application) -> web.Application:
    """GET-only /metrics, /healthz and /readyz of `main`, for a listener kubelet and Prometheus can
    reach while the verbs stay on loopback (the extender is a sidecar: only kube-scheduler calls it)."""
    app = web.Application(client_max_size=1024, middlewares=[_errors])
    app[SERVICE_KEY] = main[SERVICE_KEY]
    app[METRICS_KEY] = main[METRICS_KEY]
    app[READY_KEY] = main[READY_KEY]
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    return app


def _observe(
    metrics: Metrics,
    service: Extender,
    ready: Callable[[], tuple[bool, dict[str, Any]]],
    leader: Callable[[], bool | None],
) -> None:
    """The per-GPU gauges and the health gauges, read at scrape time (extender.observe)."""
    metrics.registry.register(
        HealthCollector(ready=ready, pending=service.pending_reasons.counts, leader=leader)
    )
    metrics.streams.append(GpuExposition(lambda: service.ledger).pieces)


def create_app(
    service: Extender,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
    ready: Callable[[], tuple[bool, dict[str, Any]]] | None = None,
    leader: Callable[[], bool | None] | None = None,
) -> web.Application:
    """`ready`: the /readyz answer (default: ready, embedded); `leader`: whether this replica
    leads (extender.observe.leader; default: always, a single instance)."""
    if max_concurrency < 1:
        raise ValueError("max_concurrency must be at least 1")
    app = web.Application(
        client_max_size=max_body_bytes, middlewares=[_errors, _concurrency_limit(max_concurrency)]
    )
    app[SERVICE_KEY] = service
    app[METRICS_KEY] = Metrics(lambda: service.ledger, service.planner_state)
    app[NAMES_KEY] = NameLists()
    app[HOSTS_KEY] = HostTables()
    for collector in service.metric_collectors():  # live mode: bind event counters
        app[METRICS_KEY].registry.register(collector)
    app[READY_KEY] = ready or (lambda: (True, {"source": "embedded"}))
    _observe(app[METRICS_KEY], service, app[READY_KEY], leader or (lambda: True))
    handlers = {"filter": _filter, "prioritize": _prioritize, "bind": _bind, "preempt": _preempt}
    for verb in VERBS:
        app.router.add_post(f"/{verb}", _timed(verb, handlers[verb]))
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/state", _state)
    app.router.add_get("/openapi.yaml", _openapi)
    app.router.add_delete(_DELETE_PATH, _delete_pod)
    # Any other verb gets a helpful 404; the GET paths are left out so that POST /healthz is a 405
    # whose Allow header lists only GET and HEAD.
    others = "|".join(re.escape(p.lstrip("/")) for p in _GET_PATHS)
    app.router.add_post(f"/{{verb:(?!(?:{others})$)[^{{}}/]+}}", _unknown_verb)
    return app
