"""A stream's text cut at the request's stop strings (`cli/serving/generation.py`), chunk by chunk."""

import asyncio

import pytest

from optimum.habana.cli.serving.generation import StopStringQueue, cut_at_stop, held_back


class ToolCall:
    """Stands for the handlers' items that are not plain text."""


CALL = ToolCall()


def drained(chunks: list, stops: tuple[str, ...]) -> list:
    """What a handler reads: `get()` until the end (None), then nothing more."""

    async def read() -> list:
        source: asyncio.Queue = asyncio.Queue()
        for chunk in chunks:
            source.put_nowait(chunk)
        queue, items = StopStringQueue(source, stops), []
        while (item := await queue.get()) is not None:
            items.append(item)
        with pytest.raises(asyncio.QueueEmpty):
            queue.get_nowait()
        return items

    return asyncio.run(read())


@pytest.mark.parametrize(
    ("chunks", "stops", "read"),
    [
        (["ab", "cX", "Yd", "e", None], ("XY",), ["ab", "c"]),  # the stop string across two chunks
        (["ab", "cX", "Zd", None], ("XY",), ["ab", "c", "XZd"]),  # held back, then not a stop string after all
        (["aX", None], ("XY",), ["a", "X"]),  # the end gives back what was held
        (["aX", CALL, "b", None], ("XY",), ["a", "X", CALL, "b"]),  # other items in their place, after the text
        (["one two", " three", None], ("nope", "o t", "two"), ["one "]),  # the first of several stop strings
        (["XY and more", None], ("XY",), []),  # at the start: nothing of the answer
        (["é🙂", "x", None], ("🙂x",), ["é"]),  # any characters
    ],
)
def test_a_stream_ends_before_its_first_stop_string(chunks, stops, read):
    assert drained(chunks, stops) == read


def test_a_whole_answer_is_cut_before_its_first_stop_string():
    assert cut_at_stop("one two three", ("three", "two")) == ("one ", True)
    assert cut_at_stop("one two", ("four",)) == ("one two", False)
    assert held_back("abcXY", ("XYZ", "YQ")) == 2 and held_back("abc", ("XYZ",)) == 0
