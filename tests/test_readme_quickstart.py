"""The README's quick start, run as written: its commands against the demo cluster must print
what the README says they print (it had drifted once)."""

from __future__ import annotations

import re
from pathlib import Path

import orjson

from extender.cluster import ClusterState
from extender.embedded import EmbeddedBinder
from extender.server import create_app
from extender.service import ExtenderService
from extender.source_file import read_cluster_file

ROOT = Path(__file__).resolve().parents[1]


def quick_start() -> tuple[dict, list[tuple[str, bytes, object]]]:
    """(the POD of the quick start, [(verb, body, expected answer)]) from README.md."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Quick start", 1)[1].split("POD='", 1)[1].split("```", 1)[0]
    pod_json, rest = block.split("'", 1)
    pod = orjson.loads(pod_json)
    calls: list[tuple[str, bytes, object]] = []
    lines = rest.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"curl -s localhost:8888/(\w+) -d (.*)$", line.strip())
        if not m:
            continue
        arg = m.group(2)
        body = arg[1:-1].replace('\\"', '"') if arg.startswith('"') else arg[1:-1]
        body = body.replace("$POD", orjson.dumps(pod).decode())
        expected = []
        for follow in lines[i + 1 :]:
            if not follow.startswith("# ") or follow.startswith("# ("):
                break
            expected.append(follow[2:].strip())
        calls.append((m.group(1), body.encode(), orjson.loads("".join(expected))))
    return pod, calls


async def test_the_quick_start_answers_are_what_the_readme_shows(aiohttp_client):
    pod, calls = quick_start()
    assert pod["metadata"]["name"] == "qwen-7b" and [c[0] for c in calls] == [
        "filter",
        "filter",
        "prioritize",
        "bind",
    ]
    cluster = ClusterState()
    cluster.load(read_cluster_file(ROOT / "config" / "demo-cluster.yaml"))
    client = await aiohttp_client(
        create_app(ExtenderService(cluster, EmbeddedBinder(cluster)))
    )  # as `make run`
    for verb, body, expected in calls:
        resp = await client.post(
            f"/{verb}", data=body, headers={"Content-Type": "application/json"}
        )
        assert resp.status == 200
        assert orjson.loads(await resp.read()) == expected, verb
