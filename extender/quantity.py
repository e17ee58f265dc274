"""Kubernetes resource quantities (`16Gi`, `15000Mi`, `40G`, `500m`, `1e3`).

Parsed exactly with `Fraction` so that `0.5Gi` or `1.5e9` never lose bytes to float
rounding; callers get integers rounded *up*, as `resource.Quantity.Value()` does.
"""

from __future__ import annotations

import re
from fractions import Fraction
from functools import lru_cache

__all__ = [
    "QuantityError",
    "parse_quantity",
    "parse_bytes",
    "parse_milli",
    "format_bytes",
    "MIB",
    "GIB",
    "HOST_MAX",
    "INTEGER",
]

KIB = 1024
MIB = 1024**2
GIB = 1024**3
TIB = 1024**4
#: CPU millicores or memory bytes beyond any node's: a node's allocatable above it reads as not
#: stated, a pod's request above it is refused (the planner keeps both in int64 arrays)
HOST_MAX = 1 << 62

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}
# Same grammar as k8s.io/apimachinery/pkg/api/resource: sign, digits with an optional
# fraction, then a binary suffix, a decimal suffix or a decimal exponent (e/E + int).
_RE = re.compile(
    r"^([+-]?)(\d+(?:\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d{1,4})?$", re.ASCII
)
_MAX_LEN = 64
#: an integer as Kubernetes reads one in a label or a selector's Gt/Lt (Go's
#: `strconv.ParseInt(s, 10, 64)`: a sign and ASCII digits; `int()` also takes `1_6` and every
#: script's digits)
INTEGER = re.compile(r"[+-]?[0-9]+", re.ASCII)


class QuantityError(ValueError):
    """A string that is not a valid Kubernetes quantity, or one out of the allowed range."""


def parse_quantity(text: object) -> Fraction:
    """Exact value of a Kubernetes quantity string; raises QuantityError naming the input."""
    if isinstance(text, Fraction):
        return text
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise QuantityError(f"{text!r} is not a quantity string")
    if isinstance(text, int):
        return Fraction(text)
    return _parse_text(text)


@lru_cache(maxsize=4096)
def _parse_text(text: str) -> Fraction:
    """Cached: a cluster repeats a handful of quantity strings (`1`, `4`, `32Gi`) on every pod,
    and Fraction arithmetic dominated start-up with 100,000 pods. Fractions are immutable."""
    s = text.strip()
    if not s or len(s) > _MAX_LEN:
        raise QuantityError(f"{text!r} is not a quantity")
    m = _RE.match(s)
    if m is None:
        raise QuantityError(f"{text!r} is not a quantity (expected e.g. 16Gi, 15000Mi, 40G)")
    sign, number, suffix = m.group(1), m.group(2), m.group(3) or ""
    value = Fraction(number)
    if suffix in _BINARY:
        value *= _BINARY[suffix]
    elif suffix in _DECIMAL:
        value *= _DECIMAL[suffix]
    else:  # decimal exponent
        exponent = int(suffix[1:])
        if abs(exponent) > 30:
            raise QuantityError(f"{text!r} is out of range")
        value *= Fraction(10) ** exponent
    return -value if sign == "-" else value


def _ceil(value: Fraction) -> int:
    return -((-value.numerator) // value.denominator)


def parse_bytes(text: object, *, maximum: int | None = None, allow_zero: bool = False) -> int:
    """A quantity as a whole number of bytes (rounded up), positive and at most `maximum`."""
    value = _ceil(parse_quantity(text))
    if value < 0 or (value == 0 and not allow_zero):
        raise QuantityError(f"{text!r} must be positive")
    if maximum is not None and value > maximum:
        raise QuantityError(f"{text!r} is larger than {format_bytes(maximum)}")
    return value


def parse_milli(text: object) -> int:
    """A quantity in thousandths (CPU `500m` -> 500, `2` -> 2000), rounded up, non-negative."""
    value = _ceil(parse_quantity(text) * 1000)
    if value < 0:
        raise QuantityError(f"{text!r} must not be negative")
    return value


def format_bytes(n: int) -> str:
    """Short human form for messages: `40Gi`, `22.5Gi`, `512Mi`, `100B`."""
    for unit, size in (("Ti", TIB), ("Gi", GIB), ("Mi", MIB), ("Ki", KIB)):
        if abs(n) >= size:
            value = n / size
            text = f"{value:.2f}".rstrip("0").rstrip(".")
            return f"{text}{unit}"
    return f"{n}B"
