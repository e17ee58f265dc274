"""One background asyncio task per component: started once, stopped by cancelling and awaiting it.

The background planner and live repacking each run one loop beside the server; both start it on
demand and, on shutdown, cancel it and wait for it to unwind, whatever it raised."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["BackgroundTask"]


class BackgroundTask:
    """A named task running `loop()`, at most one at a time."""

    def __init__(self, name: str, loop: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self.name = name
        self._loop = loop
        self.task: asyncio.Task[None] | None = None

    def start(self) -> bool:
        """Start the loop unless it runs; True when this call started it."""
        if self.task is not None:
            return False
        self.task = asyncio.create_task(self._loop(), name=self.name)
        return True

    async def stop(self) -> None:
        """Cancel the loop and wait for it: a loop that ended with an error is stopped too."""
        if self.task is None:
            return
        self.task.cancel()
        try:
            await self.task
        except (asyncio.CancelledError, Exception):
            pass
        self.task = None
