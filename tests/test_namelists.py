"""Candidate lists recognised by their bytes: a hit must be exactly what decoding would give."""

import orjson
import pytest
from builders import cluster, gpu_node, pod, service
from hypothesis import given, settings
from hypothesis import strategies as st

from extender.namelists import MEMBER, NameLists
from extender.server import NAMES_KEY, create_app

NAMES = [f"node-{i:04d}" for i in range(64)]


def body(pod_obj: dict, names: list[str]) -> bytes:
    """As Go's encoder writes ExtenderArgs: Pod, Nodes, NodeNames, compact."""
    return (
        b'{"Pod":'
        + orjson.dumps(pod_obj)
        + b',"Nodes":null,"NodeNames":'
        + orjson.dumps(names)
        + b"}"
    )


def test_a_remembered_list_is_taken_from_the_tail_and_the_head_decoded():
    lists = NameLists()
    first = body({"metadata": {"name": "a"}}, NAMES)
    assert lists.split(first) is None
    lists.remember(NAMES, raw=first)
    head, names = lists.split(body({"metadata": {"name": "b"}}, NAMES))
    assert head == {"Pod": {"metadata": {"name": "b"}}, "Nodes": None}
    assert names == NAMES and lists.hits == 1


def test_only_the_exact_compact_encoding_is_kept():
    lists = NameLists()
    spaced = b'{"Pod":{},"NodeNames": ' + orjson.dumps(NAMES) + b"}"
    lists.remember(NAMES, raw=spaced)
    assert len(lists) == 0
    lists.remember(NAMES[:3])  # short lists are not worth a comparison per request
    assert len(lists) == 0
    lists.remember(NAMES[:-1] + ["x" * 254])  # longer than a node name may be: never validated
    assert len(lists) == 0


def test_a_different_list_or_a_list_inside_a_string_is_no_hit():
    lists = NameLists()
    lists.remember(NAMES)
    tail = MEMBER + orjson.dumps(NAMES) + b"}"
    assert lists.split(body({}, NAMES[1:])) is None
    assert lists.split(b"{" + tail) is None  # `{,"NodeNames":...}` is not JSON
    assert lists.split(b'{"Pod":{},' + tail) is None
    assert lists.split(b'{"Pod":{"a":"x' + tail) is None  # the tail would sit inside a string
    assert lists.split(b'[{"Pod":{}' + tail) is None


def test_least_recently_used_lists_go_first():
    lists = NameLists(size=2)
    a, b, c = NAMES, NAMES[1:], NAMES[2:]
    for names in (a, b):
        lists.remember(names)
    assert lists.split(body({}, a)) is not None  # a is now the most recent
    lists.remember(c)
    assert lists.split(body({}, a)) is not None
    assert lists.split(body({}, b)) is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(
    prefix=st.binary(max_size=40)
    | st.dictionaries(st.text(max_size=6), json_values, max_size=3).map(
        lambda d: orjson.dumps(d)[:-1]
    ),
    cut=st.integers(0, 4),
)
def test_a_hit_always_equals_decoding_the_whole_body(prefix, cut):
    """Whatever precedes the tail (random bytes, or a JSON object missing its closing brace,
    possibly cut short), a hit is exactly `orjson.loads` of the whole body."""
    lists = NameLists()
    lists.remember(NAMES)
    raw = prefix[: max(0, len(prefix) - cut)] + MEMBER + orjson.dumps(NAMES) + b"}"
    hit = lists.split(raw)
    if hit is None:
        return
    head, names = hit
    assert orjson.loads(raw) == {**head, "NodeNames": names}


def fleet():
    """Half the nodes with 24 GiB GPUs, so filter answers carry both survivors and reasons."""
    return cluster(
        *[
            gpu_node(n, count=2, replicas=4, memory_mib=24576 if i % 2 else 81920)
            for i, n in enumerate(NAMES)
        ]
    )


@pytest.fixture
def app_and_state():
    state = fleet()
    return create_app(service(state)), state


async def test_filter_then_prioritize_hit_the_lists_and_answer_as_without_them(
    aiohttp_client, app_and_state
):
    app, _ = app_and_state
    plain_app = create_app(service(fleet()))
    plain_app[NAMES_KEY] = NameLists(size=0)  # never remembers anything: always the full decode
    fast, plain = await aiohttp_client(app), await aiohttp_client(plain_app)
    for i in range(4):
        p = pod(f"p{i}", "30Gi")
        outs = []
        for c in (fast, plain):
            f = await (await c.post("/filter", data=body(p, NAMES))).read()
            feasible = orjson.loads(f)["NodeNames"]
            s = await (await c.post("/prioritize", data=body(p, feasible))).read()
            outs.append((f, s))
        assert outs[0] == outs[1]
    # the all-nodes list from the 2nd filter on, and every prioritize list (filter's answer)
    assert app[NAMES_KEY].hits == 3 + 4
    assert plain_app[NAMES_KEY].hits == 0


async def test_a_bad_pod_with_a_remembered_list_is_still_refused(aiohttp_client, app_and_state):
    app, state = app_and_state
    client = await aiohttp_client(app)
    assert (await client.post("/filter", data=body(pod("ok", "1Gi"), NAMES))).status == 200
    resp = await client.post(
        "/filter", data=b'{"Pod":[1],"Nodes":null,"NodeNames":' + orjson.dumps(NAMES) + b"}"
    )
    assert resp.status == 400
    assert "Pod" in (await resp.json())["Error"]
    assert app[NAMES_KEY].hits == 1
