"""Every numeric flag of every command refuses NaN, infinity, out-of-range and non-numbers while
parsing, and every output file a path it cannot write: exit status 2 and a line naming the flag,
before any file is read or port opened."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from extender.cli import build_parser, main
from extender.commands.argtypes import PORT, number, output_file, whole

#: command, the arguments it needs besides the flag, and per flag a value in range and bad ones
FLAGS: list[tuple[str, list[str], str, str, list[str]]] = [
    ("simulate", ["--nodes", "n", "--pods", "p"], "--move-budget", "0", ["-0.1", "nan", "inf"]),
    ("simulate", ["--nodes", "n", "--pods", "p"], "--max-moves-per-gpu", "1", ["0", "1.5"]),
    ("simulate", ["--nodes", "n", "--pods", "p"], "--max-moves-per-pod", "1", ["0", "-2"]),
    ("simulate", ["--nodes", "n", "--pods", "p"], "--repack-time-limit", "0.5", ["0", "nan"]),
    ("simulate", ["--nodes", "n", "--pods", "p"], "--open-gpu-cost", "0.2", ["-1", "inf"]),
    ("simulate", ["--nodes", "n", "--pods", "p"], "--inflate", "0", ["-1", "nan", "inf", "11"]),
    ("simulate", ["--nodes", "n", "--pods", "p"], "--replicas", "4", ["0", "-1", "1025"]),
    ("simulate", ["--nodes", "n", "--pods", "p"], "--time-limit", "0.25", ["0", "-1", "nan"]),
    ("simulate", ["--nodes", "n", "--pods", "p"], "--workers", "1", ["0", "-1", "two"]),
    ("why", ["ns/pod"], "--headroom", "0.1", ["-0.1", "1.5", "nan"]),
    ("serve", [], "--port", "8888", ["-1", "65536"]),
    ("serve", [], "--headroom", "1", ["nan", "2"]),
    ("serve", [], "--max-body-bytes", "1048576", ["0", "-1"]),
    ("serve", [], "--max-concurrency", "1", ["0"]),
    ("serve", [], "--assume-ttl", "60", ["0", "-1", "nan", "inf"]),
    ("serve", [], "--metrics-port", "0", ["-1", "70000"]),
    ("serve", [], "--planner-time-limit", "1", ["0", "nan"]),
    ("serve", [], "--open-gpu-cost", "0", ["-1", "nan"]),
    ("serve", [], "--plan-ahead", "0", ["-1"]),
    ("serve", [], "--repack-max-moves-per-gpu", "3", ["0"]),
    ("serve", [], "--repack-max-moves-per-pod", "1", ["0"]),
    ("serve", [], "--repack-max-moves-per-minute", "6", ["0"]),
    ("serve", [], "--webhook-port", "0", ["-1", "65536"]),
    ("plan-defrag", [], "--max-moves", "0", ["-1"]),
    ("plan-defrag", [], "--max-per-namespace", "2", ["-1"]),
    ("plan-defrag", [], "--max-per-node", "2", ["-1"]),
    ("plan-defrag", [], "--time-limit", "10", ["0", "-1", "nan"]),
    ("plan-defrag", [], "--workers", "2", ["0"]),
    ("plan-mig", ["--cluster", "c"], "--time-limit", "10", ["0", "inf"]),
    ("plan-mig", ["--cluster", "c"], "--workers", "2", ["0", "3"]),
    ("estimate", ["m"], "--max-model-len", "8192", ["0", "x", "1.5K", "-1", "9" * 40 + "k"]),
    ("estimate", ["m"], "--max-num-batched-tokens", "8192", ["0", "2.5K", "3G"]),
    ("estimate", ["m"], "--kv-cache-memory-bytes", "8192", ["0", "1.5G", "9" * 17]),
    ("device-plugin", ["--node-name", "n"], "--replicas", "0", ["-1", "1025"]),
    ("device-plugin", ["--node-name", "n"], "--fake-gpus", "0", ["-1", "513"]),
    ("device-plugin", ["--node-name", "n"], "--fake-memory-mib", "16384", ["0"]),
    ("device-plugin", ["--node-name", "n"], "--probe-port", "0", ["-1", "65536"]),
]


@pytest.mark.parametrize(("value", "tokens"), [("32k", 32_000), ("32K", 32_768), ("25.6k", 25_600)])
def test_estimate_takes_token_counts_as_vllm_spells_them(value: str, tokens: int) -> None:
    args = build_parser().parse_args(["estimate", "m", "--max-model-len", value])
    assert args.max_model_len == tokens


@pytest.mark.parametrize(("command", "needs", "flag", "good", "bad"), FLAGS)
def test_a_bad_number_stops_the_command_while_parsing(
    command: str,
    needs: list[str],
    flag: str,
    good: str,
    bad: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    args = parser.parse_args([command, *needs, flag, good])
    assert getattr(args, flag.lstrip("-").replace("-", "_")) == float(good)
    for value in bad:
        with pytest.raises(SystemExit) as stop:
            parser.parse_args([command, *needs, flag, value])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}: must be " in err and repr(value) in err, err


def test_simulate_stops_before_reading_its_inputs(tmp_path, capsys) -> None:
    """The bad flag is reported; the missing files are not even opened, nothing is written."""
    plot = tmp_path / "out.png"
    with pytest.raises(SystemExit) as stop:
        main(
            [
                "simulate",
                "--nodes",
                str(tmp_path / "missing.csv"),
                "--pods",
                str(tmp_path / "missing.csv"),
                "--move-budget",
                "inf",
                "--plot",
                str(plot),
            ]
        )
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "argument --move-budget: must be a finite number >= 0, got 'inf'" in err
    assert "cannot read inputs" not in err and not plot.exists()


@pytest.mark.parametrize(
    ("parse", "text", "value"),
    [
        (number(at_least=0), "0", 0.0),
        (number(at_least=0), "1e3", 1000.0),
        (number(above=0), "0.001", 0.001),
        (number(at_least=0, at_most=1), "1", 1.0),
        (whole(at_least=1), "7", 7),
        (PORT, "65535", 65535),
        (PORT, "0", 0),
    ],
)
def test_values_in_range_parse(parse, text: str, value: float) -> None:
    assert parse(text) == value


@pytest.mark.parametrize(
    ("parse", "text", "says"),
    [
        (number(at_least=0), "1e400", "a finite number >= 0"),
        (number(at_least=0), "-inf", "a finite number >= 0"),
        (number(above=0), "0", "a finite number > 0"),
        (number(at_least=0, at_most=1), "1.01", "a finite number >= 0 and <= 1"),
        (number(), "NaN", "a finite number"),
        (whole(at_least=1), "1.0", "a whole number >= 1"),
        (whole(at_least=0, at_most=2), "3", "a whole number >= 0 and <= 2"),
        (PORT, "http", "a whole number >= 0 and <= 65535"),
        # A large bound is written in full, not as `2.14748e+09`.
        (
            whole(at_least=1, at_most=2**31 - 1),
            "2147483648",
            "a whole number >= 1 and <= 2147483647",
        ),
    ],
)
def test_values_out_of_range_say_what_is_wanted(parse, text: str, says: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as bad:
        parse(text)
    assert str(bad.value) == f"must be {says}, got {text!r}"


@pytest.mark.parametrize(
    ("command", "needs", "flag"),
    [
        ("simulate", ["--nodes", "n", "--pods", "p"], "--plot"),
        ("simulate", ["--nodes", "n", "--pods", "p"], "--budget-curve"),
        ("plan-mig", ["--cluster", "c"], "--output-yaml"),
    ],
)
def test_an_output_file_that_cannot_be_written_stops_the_command_first(
    tmp_path, capsys, command: str, needs: list[str], flag: str
) -> None:
    """These files are written after a replay or a solve of minutes: a path whose folder does
    not exist used to end that run in a FileNotFoundError traceback."""
    parser = build_parser()
    good = tmp_path / "out.file"
    assert (
        parser.parse_args([command, *needs, flag, str(good)]).__dict__[
            flag.lstrip("-").replace("-", "_")
        ]
        == good
    )
    for bad, says in (
        (str(tmp_path / "missing" / "out.png"), "no folder"),
        (str(tmp_path), "is not a file name"),
    ):
        with pytest.raises(SystemExit) as stop:
            parser.parse_args([command, *needs, flag, bad])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}: " in err and says in err, err


def test_an_output_file_in_a_folder_it_may_not_write_is_refused(tmp_path, monkeypatch) -> None:
    """As the folder's permissions say (os.access; faked here, since root writes anywhere)."""
    target = tmp_path / "x.png"
    assert output_file(str(target)) == target
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path)
    with pytest.raises(argparse.ArgumentTypeError, match="cannot write .*x.png: permission denied"):
        output_file(str(target))
