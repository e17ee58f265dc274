"""The floor: an extender that does nothing but parse the same requests and answer validly.

Same runtime as vramsched (aiohttp, default event loop, orjson, no access log), so the ratio
of vramsched's latency to this one's is the cost of vramsched's decisions, and holds on a
noisy machine where absolute milliseconds do not. Answers: every sent node passes filter,
prioritize has no opinion (`[]`, which kube-scheduler reads as no extender score), bind
succeeds.

    python -m loadtest.floor --port 8891
"""

from __future__ import annotations

import argparse

import orjson
from aiohttp import web

from extender.commands.argtypes import whole

_JSON = "application/json"


async def _filter(request: web.Request) -> web.Response:
    args = orjson.loads(await request.read())
    return web.Response(
        body=orjson.dumps(
            {
                "Nodes": None,
                "NodeNames": args.get("NodeNames") or [],
                "FailedNodes": {},
                "FailedAndUnresolvableNodes": {},
                "Error": "",
            }
        ),
        content_type=_JSON,
    )


async def _prioritize(request: web.Request) -> web.Response:
    orjson.loads(await request.read())
    return web.Response(body=b"[]", content_type=_JSON)


async def _bind(request: web.Request) -> web.Response:
    orjson.loads(await request.read())
    return web.Response(body=b'{"Error":""}', content_type=_JSON)


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def create_app() -> web.Application:
    app = web.Application(client_max_size=128 * 1024 * 1024)
    app.router.add_post("/filter", _filter)
    app.router.add_post("/prioritize", _prioritize)
    app.router.add_post("/bind", _bind)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _healthz)
    return app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="floor extender for the load test")
    p.add_argument("--host", default="127.0.0.1")
    # not 0: the floor prints nothing, so no one would learn the port it got
    p.add_argument("--port", type=whole(at_least=1, at_most=65535), default=8891)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:  # the same event loop as `vramsched serve` (extender/commands/serve.py)
        import uvloop
    except ImportError:
        loop = None
    else:
        loop = uvloop.new_event_loop()
    web.run_app(
        create_app(),
        host=args.host,
        port=args.port,
        access_log=None,
        print=None,
        backlog=1024,
        loop=loop,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
