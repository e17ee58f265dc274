from fractions import Fraction

import pytest

from extender.quantity import (
    GIB,
    MIB,
    QuantityError,
    format_bytes,
    parse_bytes,
    parse_milli,
    parse_quantity,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("16Gi", 16 * GIB),
        ("15000Mi", 15000 * MIB),
        ("40G", 40 * 10**9),
        ("1.5Gi", 3 * GIB // 2),
        ("0.5Ki", 512),
        ("1e9", 10**9),
        ("1E3", 1000),
        ("2.5e-3", Fraction(1, 400)),
        ("+7", 7),
        (".5Gi", GIB // 2),
        ("1Ti", 1024 * GIB),
        ("100m", Fraction(1, 10)),
        (12, 12),
    ],
)
def test_parse_quantity_exact(text, expected):
    assert parse_quantity(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "16Gx",
        "",
        " ",
        "Gi",
        "16 Gi",
        "1e400",
        "NaN",
        "inf",
        "--1",
        "1.2.3",
        "0x10",
        "1e",
        None,
        True,
        1.5,
        [],
        "9" * 100,
        "١٦Gi",  # Arabic-Indic digits: Python's \d and int() take them, Kubernetes does not
        "１６Gi",  # fullwidth digits
        "1_6Gi",
    ],
)
def test_parse_quantity_rejects(text):
    with pytest.raises(QuantityError):
        parse_quantity(text)


def test_parse_bytes_rounds_up_and_bounds():
    assert parse_bytes("1.0000001") == 2
    assert parse_bytes("100m") == 1
    with pytest.raises(QuantityError, match="must be positive"):
        parse_bytes("0")
    with pytest.raises(QuantityError, match="must be positive"):
        parse_bytes("-1")
    assert parse_bytes("0", allow_zero=True) == 0
    with pytest.raises(QuantityError, match="larger than"):
        parse_bytes("2Ti", maximum=GIB)


def test_parse_milli():
    assert parse_milli("500m") == 500
    assert parse_milli("2") == 2000
    assert parse_milli("0.1") == 100
    with pytest.raises(QuantityError):
        parse_milli("-1")


@pytest.mark.parametrize(
    "n, text",
    [
        (40 * GIB, "40Gi"),
        (22 * GIB + GIB // 2, "22.5Gi"),
        (512 * MIB, "512Mi"),
        (100, "100B"),
        (2 * 1024 * GIB, "2Ti"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text
