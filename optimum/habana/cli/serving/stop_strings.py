"""A request's `stop` strings, cut from its answer as OpenAI's API does ("The returned text will not contain the
stop sequence").

transformers' server hands `stop` to generate() as `stop_strings`, which ends generation once one appears in the
tokens, and answers the whole decoded text: the stop string, and the rest of the token that completed it, included.
A whole answer is cut before the first stop string; a stream holds back the text that may be the start of one
until the next text shows whether it is, and ends where one begins.
"""

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any


def stop_strings_of(gen_config: Any) -> tuple[str, ...]:
    stops = getattr(gen_config, "stop_strings", None)
    if stops is None:
        return ()
    return tuple(stop for stop in ([stops] if isinstance(stops, str) else stops) if stop)


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """The text before the first stop string, and whether one was found."""
    found = [index for index in (text.find(stop) for stop in stops) if index >= 0]
    return (text[: min(found)], True) if found else (text, False)


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` may begin a stop string that the next text would complete."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class StopStringQueue:
    """A stream's queue as transformers' handlers read it (`get`, `get_nowait`), its text cut at the stop strings.

    Items other than text (the end, `None`; errors; tool calls and reasoning, which are not plain `str`) pass as they
    come, after the text held back before them.
    """

    def __init__(
        self, source: asyncio.Queue, stops: tuple[str, ...], on_stop: Callable[[], None] = lambda: None
    ) -> None:
        self.source, self.stops, self.on_stop = source, stops, on_stop
        self.pending = ""  # text that may begin a stop string
        self.stopped = False
        self.ready: deque = deque()

    async def get(self) -> Any:
        while not self.ready:
            self.take(await self.source.get())
        return self.ready.popleft()

    def get_nowait(self) -> Any:
        while not self.ready:
            self.take(self.source.get_nowait())  # asyncio.QueueEmpty when nothing has come
        return self.ready.popleft()

    def take(self, item: Any) -> None:
        if self.stopped:  # generation ends by itself past a stop string; what it still sends is not the answer's
            return
        if type(item) is not str:
            if self.pending:
                self.ready.append(self.pending)
                self.pending = ""
            self.ready.append(item)
            return
        text, found = cut_at_stop(self.pending + item, self.stops)
        if found:
            self.stopped = True
            self.on_stop()  # a stop string generate()'s own criterion missed (no token spells it): nothing more is read
            self.ready.extend([text, None] if text else [None])
            self.pending = ""
            return
        keep = held_back(text, self.stops)
        self.pending = text[len(text) - keep :] if keep else ""
        if text[: len(text) - keep]:
            self.ready.append(text[: len(text) - keep])
