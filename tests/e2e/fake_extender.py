"""An extender on a loopback port whose answers a test scripts verb by verb, and which records
every call kube-scheduler makes (when, which verb, the body, the HTTP status it answered).

Why: to see what a real kube-scheduler does with a given answer (an error, a timeout, an
unresolvable node), the answer must be exactly the one under test. By default it behaves like a
permissive extender: filter passes every node, prioritize gives no scores, bind creates the
Binding (the extender's job when it is the binder). With ``forward_to`` it is a recording proxy
in front of a real extender (vramsched), so a test sees the very bytes kube-scheduler sent it.

This module deliberately does not import pytest.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import kubernetes.client
from controlplane import ControlPlane

Handler = Callable[[dict[str, Any]], tuple[int, Any]]
"""A verb's script: request body -> (HTTP status, JSON answer)."""


@dataclass
class Call:
    at: float  # time.monotonic() when the request arrived
    verb: str
    body: dict[str, Any]
    status: int = 0  # 0 while the answer is being worked out
    answer: Any = None

    @property
    def pod(self) -> str | None:
        """The pod's name: from ``Pod`` (filter, prioritize, preempt) or ``PodName`` (bind)."""
        pod = self.body.get("Pod") or {}
        return (pod.get("metadata") or {}).get("name") or self.body.get("PodName")


class FakeExtender:
    """``url`` is the urlPrefix to configure; ``calls`` grows as kube-scheduler calls."""

    def __init__(
        self,
        cp: ControlPlane,
        handlers: dict[str, Handler] | None = None,
        *,
        forward_to: str | None = None,
    ) -> None:
        self.calls: list[Call] = []
        self.handlers = dict(handlers or {})
        self.forward_to = forward_to
        self.api = cp.api_client()
        self._lock = threading.Lock()
        fake = self

        class Server(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                at = time.monotonic()
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                call = Call(at, self.path.rsplit("/", 1)[-1], body)
                with fake._lock:  # recorded on arrival: a slow answer may never be read
                    fake.calls.append(call)
                call.status, call.answer = fake.answer(call.verb, body)
                data = json.dumps(call.answer).encode()
                try:
                    self.send_response(call.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # kube-scheduler gave up waiting (its httpTimeout)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Server)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/scheduler"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, verb: str, body: dict[str, Any]) -> tuple[int, Any]:
        handler = self.handlers.get(verb)
        if handler is not None:
            return handler(body)
        if self.forward_to is not None:
            return self.forward(verb, body)
        return 200, self.default(verb, body)

    def default(self, verb: str, body: dict[str, Any]) -> Any:
        """The permissive answers: every node passes, no scores, bind writes the Binding."""
        if verb == "filter":
            return {
                "Nodes": body.get("Nodes"),
                "NodeNames": body.get("NodeNames"),
                "FailedNodes": {},
                "FailedAndUnresolvableNodes": {},
                "Error": "",
            }
        if verb == "prioritize":
            return []
        if verb == "bind":
            self.bind(body)
            return {"Error": ""}
        return {"Error": f"unexpected verb {verb}"}

    def bind(self, body: dict[str, Any]) -> None:
        """Create the Binding kube-scheduler asked for (ExtenderBindingArgs)."""
        kubernetes.client.CoreV1Api(self.api).create_namespaced_binding(
            body["PodNamespace"],
            {
                "metadata": {"name": body["PodName"], "uid": body["PodUID"]},
                "target": {"kind": "Node", "name": body["Node"]},
            },
            _preload_content=False,  # the server answers a Status, not a Binding
        )

    def forward(self, verb: str, body: dict[str, Any]) -> tuple[int, Any]:
        """Send the call on to `forward_to` and return its answer (a handler may call it)."""
        req = urllib.request.Request(
            f"{self.forward_to}/{verb}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def calls_for(self, pod: str, verb: str | None = None) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if c.pod == pod and (verb is None or c.verb == verb)]

    def verbs_for(self, pod: str) -> list[str]:
        return [c.verb for c in self.calls_for(pod)]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.api.close()


def scripted(*answers: tuple[int, Any], then: Handler | None = None) -> tuple[Handler, list[int]]:
    """A handler that gives ``answers`` in turn, then defers to ``then`` (or repeats the last).

    Returns the handler and a one-element list counting the calls it has seen.
    """
    seen = [0]
    lock = threading.Lock()

    def handler(body: dict[str, Any]) -> tuple[int, Any]:
        with lock:
            i = seen[0]
            seen[0] += 1
        if i < len(answers):
            return answers[i]
        if then is not None:
            return then(body)
        return answers[-1]

    return handler, seen
