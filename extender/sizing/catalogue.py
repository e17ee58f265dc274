"""The models vramsched knows by name (catalogue.yaml, shipped with the package).

Lookups are case-insensitive on the Hugging Face id, the id without its organisation, and the
aliases; an unknown name fails with the closest known names, so a typo costs one retry.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from functools import lru_cache
from importlib.resources import files
from typing import Any

import yaml

from extender.sizing.architecture import Architecture, architecture_from_config
from extender.sizing.errors import SizingError

__all__ = ["Entry", "entries", "lookup", "is_known"]


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    aliases: tuple[str, ...]
    config: dict[str, Any]
    checkpoint_bytes: int | None  # published total_size; None: derived only
    lm_head_stored: bool
    extra_params: int

    @property
    def architecture(self) -> Architecture:
        return _architecture(self.name)


@lru_cache(maxsize=1)
def entries() -> tuple[Entry, ...]:
    raw = yaml.safe_load(files("extender.sizing").joinpath("catalogue.yaml").read_text())
    out = []
    for item in raw["models"]:
        out.append(
            Entry(
                name=item["name"],
                aliases=tuple(item.get("aliases") or ()),
                config=dict(item["config"]),
                checkpoint_bytes=item.get("checkpoint_bytes"),
                lm_head_stored=bool(item.get("lm_head_stored", False)),
                extra_params=int(item.get("extra_params", 0)),
            )
        )
    return tuple(out)


@lru_cache(maxsize=1)
def _index() -> dict[str, Entry]:
    index: dict[str, Entry] = {}
    for e in entries():
        for key in (e.name, e.name.split("/", 1)[-1], *e.aliases):
            index.setdefault(key.lower(), e)
    return index


@lru_cache(maxsize=256)
def _architecture(name: str) -> Architecture:
    e = _index()[name.lower()]
    return architecture_from_config(e.config, extra_params=e.extra_params)


def is_known(name: str) -> bool:
    return name.strip().lower() in _index()


def lookup(name: str) -> Entry:
    """The catalogue entry for `name`; SizingError suggests the closest names when unknown."""
    key = name.strip().lower()
    found = _index().get(key)
    if found is not None:
        return found
    names = {e.name.lower(): e.name for e in entries()}
    names.update({a.lower(): a for e in entries() for a in e.aliases})
    close = difflib.get_close_matches(key, list(names), n=3, cutoff=0.6)
    if not close:  # a family prefix ("qwen3") or a shortened id: offer names that contain it
        stem = key.split("/")[-1]
        close = [k for k in names if stem and stem in k][:3]
    hint = f"; did you mean {', '.join(names[c] for c in close)}?" if close else ""
    raise SizingError(
        f"unknown model {name!r}: not in vramsched's catalogue and not a local directory{hint}"
    )
