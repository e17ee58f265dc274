"""Candidate node lists recognised by their bytes, so a 5,000-name list is decoded once, not per call.

kube-scheduler (nodeCacheCapable, percentageOfNodesToScore: 100) sends filter the same NodeNames
list pod after pod, and prioritize the very list filter answered. Decoding and validating 5,000
names costs more than deciding where the pod fits; comparing the tail of the body with a known
encoding is one memcmp. Go's encoder writes the ExtenderArgs fields in declaration order (Pod,
Nodes, NodeNames), compactly, so the list is the body's last member.

Why reading only the head is exact: if `head + b"}"` parses as a JSON object with at least one
member, the lexer is between members of the top-level object at the end of `head`, so appending
`,"NodeNames":<a valid array>}` yields a valid object whose NodeNames is that array (a duplicate
key loses to the last one, in orjson as here). Anything else falls back to decoding everything.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["NameLists", "MEMBER"]

MEMBER = b',"NodeNames":'


class NameLists:
    """The last few candidate lists, each with its compact JSON encoding (the one Go and orjson write).

    Only lists that came from a validated request or from vramsched's own filter answer are kept,
    so a hit is exactly what decoding would have produced. Lists handed out are shared: callers
    must not mutate them.
    """

    def __init__(self, size: int = 16, min_names: int = 32, max_name: int = 253) -> None:
        self.size = size
        self.min_names = min_names
        self.max_name = max_name
        #: (tail bytes `,"NodeNames":[...]}`, the list), most recently used first
        self._entries: list[tuple[bytes, list[str]]] = []
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def split(self, raw: bytes) -> tuple[dict[str, Any], list[str]] | None:
        """(the body without its NodeNames member, decoded; the remembered list) when `raw` ends with
        a remembered list, else None (the caller then decodes the whole body)."""
        n = len(raw)
        for i, (tail, names) in enumerate(self._entries):
            if n > len(tail) and raw.endswith(tail):
                try:
                    head = orjson.loads(raw[: n - len(tail)] + b"}")
                except orjson.JSONDecodeError:
                    return None
                if not isinstance(head, dict) or not head:
                    return None
                if i:
                    self._entries.insert(0, self._entries.pop(i))
                self.hits += 1
                return head, names
        return None

    def remember(
        self,
        names: list[str],
        encoded: bytes | None = None,
        raw: bytes | None = None,
        short_names: bool = False,
    ) -> bytes | None:
        """Keep `names` (its encoding `encoded`, computed when not given) for later `split`s; with
        `raw`, only when that body ends with exactly this encoding (else a later body never would).
        `short_names`: the caller knows every name is at most `max_name` long (a filter answer is a
        subset of its request's names, which were validated or came from a list checked here), so
        the check is skipped: it costs ~30 ns per name, 7x the encoding itself.
        Returns the encoding, or None when the list is not kept (short, or a name too long)."""
        if len(names) < self.min_names:
            return encoded
        if encoded is None:
            encoded = orjson.dumps(names)
        tail = MEMBER + encoded + b"}"
        if raw is not None and not raw.endswith(tail):
            return encoded
        for i, (t, _) in enumerate(self._entries):
            if t == tail:
                if i:
                    self._entries.insert(0, self._entries.pop(i))
                return encoded
        if not short_names and max(map(len, names)) > self.max_name:
            return encoded
        self._entries.insert(0, (tail, names))
        del self._entries[self.size :]
        return encoded
