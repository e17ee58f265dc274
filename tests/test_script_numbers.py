"""Every numeric flag of the benchmarks' and the load test's scripts refuses NaN, infinity,
out-of-range values and non-numbers while parsing, and every file written after a long run a path
it cannot write: exit status 2 and a line naming the flag, before any work is done.

The parsers are built by each script's `build_parser()`; importing a script only defines things
(none imports locust or gevent), so they are tested in this process. A table of flags that missed
one would be caught by `test_the_table_names_every_numeric_flag`."""

from __future__ import annotations

import argparse
import importlib
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from extender.commands.argtypes import output_file

ROOT = Path(__file__).resolve().parent.parent

SCRIPTS = (
    "benchmarks.bound_choices",
    "benchmarks.device_plugin",
    "benchmarks.hot_path",
    "benchmarks.kube_scoring",
    "benchmarks.llm_mixed",
    "benchmarks.metrics_scrape",
    "benchmarks.mig_geometry",
    "benchmarks.plan_ahead",
    "benchmarks.planner_rules",
    "benchmarks.planner_scaling",
    "benchmarks.trace_packing",
    "loadtest.floor",
    "loadtest.gen_cluster",
    "loadtest.run",
    "loadtest.scrape_ab",
    "loadtest.soak",
)

#: what a script's parser needs besides the flag under test (positionals, required options)
NEEDS: dict[str, list[str]] = {
    "benchmarks.planner_rules": ["portfolio"],
    "loadtest.gen_cluster": ["--out", "cluster.json"],
}

#: script, flag, a value in range, values refused
FLAGS: list[tuple[str, str, str, list[str]]] = [
    ("benchmarks.bound_choices", "--move-budget", "0", ["-0.1", "nan", "inf"]),
    ("benchmarks.bound_choices", "--time-limit", "0.25", ["0", "-1", "nan"]),
    ("benchmarks.bound_choices", "--rows", "1", ["0", "1.5", "x"]),
    ("benchmarks.device_plugin", "--pods", "1", ["0", "-1", "nan"]),
    ("benchmarks.device_plugin", "--seed", "0", ["-1", "1.5"]),
    ("benchmarks.device_plugin", "--quiet", "0.5", ["0", "nan", "inf"]),
    ("benchmarks.device_plugin", "--timeout", "300", ["0", "-5", "nan"]),
    ("benchmarks.device_plugin", "--rounds", "1", ["0", "nan"]),
    ("benchmarks.device_plugin", "--kubelet-rounds", "1", ["0", "nan"]),
    ("benchmarks.device_plugin", "--kubelet-repeats", "1", ["0", "inf"]),
    ("benchmarks.hot_path", "--nodes", "100", ["0", "-1", "nan"]),
    ("benchmarks.hot_path", "--cycles", "1", ["0", "nan"]),
    ("benchmarks.hot_path", "--occupancy", "1", ["-0.1", "1.5", "nan"]),
    ("benchmarks.hot_path", "--seed", "0", ["-1", "nan"]),
    ("benchmarks.kube_scoring", "--inflate", "0", ["-1", "nan", "inf", "11"]),
    ("benchmarks.llm_mixed", "--time-limit", "0.25", ["0", "nan"]),
    ("benchmarks.llm_mixed", "--repack-time-limits", "5", ["0", "-1", "inf"]),
    ("benchmarks.llm_mixed", "--loads", "100", ["0", "nan"]),
    ("benchmarks.llm_mixed", "--streams", "1", ["0", "-2", "nan"]),
    ("benchmarks.llm_mixed", "--move-budget", "1", ["-0.01", "1.5", "nan"]),
    ("benchmarks.metrics_scrape", "--nodes", "1", ["0", "nan"]),
    ("benchmarks.metrics_scrape", "--gpus", "73", ["0", "74", "nan"]),
    ("benchmarks.mig_geometry", "--time-limit", "30", ["0", "nan"]),
    ("benchmarks.mig_geometry", "--uniform-time-limit", "10", ["0", "inf"]),
    ("benchmarks.mig_geometry", "--workers", "1", ["0", "-1", "nan"]),
    ("benchmarks.mig_geometry", "--seed", "0", ["-1", "nan"]),
    ("benchmarks.mig_geometry", "--pending", "1500", ["0", "nan"]),
    ("benchmarks.plan_ahead", "--nodes", "100", ["0", "nan"]),
    ("benchmarks.plan_ahead", "--types", "1", ["0", "nan"]),
    ("benchmarks.plan_ahead", "--repeat", "1", ["0", "-1"]),
    ("benchmarks.planner_rules", "--workers", "1", ["0", "nan"]),
    ("benchmarks.planner_rules", "--shuffle-orders", "0", ["-1", "nan"]),
    ("benchmarks.planner_rules", "--inflate", "1.3", ["-1", "nan", "11"]),
    ("benchmarks.planner_rules", "--shuffle-nodes", "0", ["-1", "x"]),
    ("benchmarks.planner_rules", "--checkpoints", "0.5", ["-0.1", "1.1", "nan"]),
    ("benchmarks.planner_rules", "--depth", "1.3", ["0", "nan", "inf"]),
    ("benchmarks.planner_rules", "--prefix", "1", ["0", "1.5", "nan"]),
    ("benchmarks.planner_scaling", "--nodes", "100", ["0", "nan"]),
    ("benchmarks.planner_scaling", "--pods", "1", ["0", "-1"]),
    ("benchmarks.planner_scaling", "--time-limit", "1", ["0", "nan"]),
    ("benchmarks.planner_scaling", "--workers", "1", ["0", "nan"]),
    ("benchmarks.planner_scaling", "--seed", "0", ["-1", "nan"]),
    ("benchmarks.trace_packing", "--inflate", "0", ["-1", "nan", "11"]),
    ("benchmarks.trace_packing", "--time-limit", "1", ["0", "nan"]),
    ("benchmarks.trace_packing", "--move-budget", "0", ["-1", "inf"]),
    ("benchmarks.trace_packing", "--repack-time-limit", "1", ["0", "nan"]),
    ("benchmarks.trace_packing", "--budgets", "0.02", ["-0.01", "nan"]),
    ("benchmarks.trace_packing", "--shuffle-nodes", "1", ["-1", "nan"]),
    ("loadtest.floor", "--port", "8891", ["0", "65536", "nan"]),
    ("loadtest.gen_cluster", "--nodes", "1", ["0", "nan"]),
    ("loadtest.gen_cluster", "--gpus", "73", ["0", "74", "nan"]),
    ("loadtest.gen_cluster", "--occupancy", "0", ["-0.1", "1.01", "nan"]),
    ("loadtest.gen_cluster", "--seed", "0", ["-1", "nan"]),
    ("loadtest.run", "--nodes", "1", ["0", "nan"]),
    ("loadtest.run", "--gpus", "1", ["0", "74"]),
    ("loadtest.run", "--occupancy", "0.6", ["-1", "2", "nan"]),
    ("loadtest.run", "--seed", "0", ["-1"]),
    ("loadtest.run", "--users", "1", ["0", "nan"]),
    ("loadtest.run", "--rate", "0", ["-1", "nan", "inf"]),
    ("loadtest.run", "--processes", "1", ["0", "-1"]),
    ("loadtest.run", "--warmup", "0", ["-1", "nan"]),
    ("loadtest.scrape_ab", "--nodes", "1", ["0", "nan"]),
    ("loadtest.scrape_ab", "--gpus", "8", ["0", "74"]),
    ("loadtest.scrape_ab", "--users", "1", ["0"]),
    ("loadtest.scrape_ab", "--rounds", "1", ["0", "nan"]),
    ("loadtest.scrape_ab", "--interval", "0", ["-1", "nan", "inf"]),
    ("loadtest.soak", "--nodes", "1", ["0", "nan"]),
    ("loadtest.soak", "--gpus", "8", ["0", "74"]),
    ("loadtest.soak", "--occupancy", "1", ["-0.5", "1.5", "nan"]),
    ("loadtest.soak", "--seed", "0", ["-1"]),
    ("loadtest.soak", "--users", "1", ["0"]),
    ("loadtest.soak", "--churn", "0", ["-1", "nan"]),
    ("loadtest.soak", "--sample", "0.5", ["0", "nan"]),
]

#: files written once a long run is done: the folder must exist and be writable
OUTPUTS: list[tuple[str, str]] = [
    ("benchmarks.bound_choices", "--out"),
    ("benchmarks.device_plugin", "--out"),
    ("benchmarks.hot_path", "--json"),
    ("benchmarks.llm_mixed", "--json"),
    ("benchmarks.mig_geometry", "--write-cluster"),
    ("benchmarks.planner_rules", "--out"),
    ("benchmarks.planner_scaling", "--out"),
]

#: what `python ...` runs each script as (as its docstring and the Makefile do)
COMMANDS: dict[str, list[str]] = {
    name: (
        ["-m", name]
        if name.startswith("loadtest.")
        or name in ("benchmarks.hot_path", "benchmarks.metrics_scrape", "benchmarks.plan_ahead")
        else [name.replace(".", "/") + ".py"]
    )
    for name in SCRIPTS
}


def _import(name: str) -> ModuleType:
    """The script as a module; the folders some put on sys.path are taken off again."""
    saved = list(sys.path)
    try:
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved


@pytest.fixture(scope="module")
def scripts() -> dict[str, ModuleType]:
    return {name: _import(name) for name in SCRIPTS}


def _action(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in parser._actions if flag in a.option_strings)


def _typed(parser: argparse.ArgumentParser, *names: str) -> set[str]:
    """The flags whose type is one of the argtypes parsers named."""
    return {
        a.option_strings[0]
        for a in parser._actions
        if a.option_strings and getattr(a.type, "__name__", None) in names
    }


@pytest.mark.parametrize(("script", "flag", "good", "bad"), FLAGS)
def test_a_bad_number_stops_the_script_while_parsing(
    scripts: dict[str, ModuleType],
    script: str,
    flag: str,
    good: str,
    bad: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = scripts[script].build_parser()
    needs = NEEDS.get(script, [])
    got = getattr(parser.parse_args([*needs, flag, good]), _action(parser, flag).dest)
    many = _action(parser, flag).nargs in ("*", "+")
    assert got == ([float(good)] if many else float(good))
    for value in bad:
        with pytest.raises(SystemExit) as stop:
            parser.parse_args([*needs, flag, value])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}: must be " in err and repr(value) in err, err


@pytest.mark.parametrize(("script", "flag"), OUTPUTS)
def test_an_output_file_that_cannot_be_written_stops_the_script_while_parsing(
    scripts: dict[str, ModuleType],
    script: str,
    flag: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = scripts[script].build_parser()
    needs = NEEDS.get(script, [])
    args = parser.parse_args([*needs, flag, str(tmp_path / "results.json")])
    assert getattr(args, _action(parser, flag).dest) == tmp_path / "results.json"
    missing = tmp_path / "no-such-folder" / "results.json"
    for value in (str(missing), str(tmp_path)):
        with pytest.raises(SystemExit) as stop:
            parser.parse_args([*needs, flag, value])
        assert stop.value.code == 2
        assert f"argument {flag}: " in capsys.readouterr().err
    assert not missing.parent.exists()


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_table_names_every_numeric_flag(scripts: dict[str, ModuleType], script: str) -> None:
    """No plain float or int is left, and every argtypes number and output file is in a table."""
    parser = scripts[script].build_parser()
    plain = [a.option_strings or a.dest for a in parser._actions if a.type in (float, int)]
    assert plain == []
    assert _typed(parser, "number", "whole") == {f for s, f, _, _ in FLAGS if s == script}
    assert {a.option_strings[0] for a in parser._actions if a.type is output_file} == {
        f for s, f in OUTPUTS if s == script
    }


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_defaults_are_in_range(scripts: dict[str, ModuleType], script: str) -> None:
    """argparse runs `type` on a default only when it is a string: every other default is put
    through its flag's type here, and must come back unchanged."""
    parser = scripts[script].build_parser()
    parser.parse_args(NEEDS.get(script, []))
    for action in parser._actions:
        if getattr(action.type, "__name__", None) not in ("number", "whole"):
            continue
        assert action.type is not None
        defaults = action.default if isinstance(action.default, list) else [action.default]
        for value in defaults:
            if value is None:
                continue
            assert isinstance(value, int | float) and math.isfinite(value)
            assert action.type(repr(value)) == value, (action.option_strings, value)


@pytest.mark.parametrize("script", SCRIPTS)
def test_main_parses_with_build_parser(
    scripts: dict[str, ModuleType],
    script: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`main` stops at the bad flag, through the parser `build_parser` makes."""
    module = scripts[script]
    flag = next(f for s, f, _, _ in FLAGS if s == script)
    built = []

    def build_parser() -> argparse.ArgumentParser:
        built.append(True)
        return real()

    real = module.build_parser
    monkeypatch.setattr(module, "build_parser", build_parser)
    monkeypatch.setattr(sys, "argv", [script, *NEEDS.get(script, []), flag, "nan"])
    with pytest.raises(SystemExit) as stop:
        module.main()
    assert stop.value.code == 2 and built == [True]
    assert f"argument {flag}: must be " in capsys.readouterr().err


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_script_stops_at_a_bad_number_when_run(script: str) -> None:
    """Run as the Makefile and the docs run it: its imports of argtypes resolve."""
    flag = next(f for s, f, _, _ in FLAGS if s == script)
    proc = subprocess.run(
        [sys.executable, *COMMANDS[script], *NEEDS.get(script, []), flag, "inf"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"argument {flag}: must be " in proc.stderr


def test_trace_packing_checks_out_before_the_replays_only(
    scripts: dict[str, ModuleType], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """trace_packing's --out is also what --summary and the other reports read: it is checked
    where the run (or --merge) will write it, not where it is only read."""
    main = scripts["benchmarks.trace_packing"].main
    missing = tmp_path / "no-such-folder" / "trace_packing.json"
    for argv in (["--lists", "default"], ["--merge", str(tmp_path / "part.json")]):
        with pytest.raises(SystemExit) as stop:
            main([*argv, "--out", str(missing)])
        assert stop.value.code == 2
        assert "argument --out: cannot write" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError):  # read, not refused while parsing
        main(["--summary", "--out", str(missing)])


@pytest.mark.parametrize(
    ("script", "flag", "zero_ok"),
    [
        ("loadtest.run", "--duration", False),
        ("loadtest.scrape_ab", "--duration", False),
        ("loadtest.soak", "--probe", False),
        ("loadtest.soak", "--duration", False),
        ("loadtest.soak", "--warmup", True),
    ],
)
def test_a_bad_run_time_stops_the_script_while_parsing(
    scripts: dict[str, ModuleType],
    script: str,
    flag: str,
    zero_ok: bool,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Run times stay text (locust takes them so) but are checked while parsing."""
    parser = scripts[script].build_parser()
    needs = NEEDS.get(script, [])
    dest = _action(parser, flag).dest
    assert getattr(parser.parse_args([*needs, flag, "1m30s"]), dest) == "1m30s"
    bad = ["ten", "1x", "-5s", *([] if zero_ok else ["0s"])]
    for value in bad:
        with pytest.raises(SystemExit) as stop:
            parser.parse_args([*needs, f"{flag}={value}"])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}: duration {value!r}" in err, err
    if zero_ok:
        assert getattr(parser.parse_args([*needs, flag, "0s"]), dest) == "0s"
