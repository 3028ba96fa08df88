"""Stop strings matched on the text at the end of each sequence, in time linear in the text.

transformers' `StopStringCriteria` decides with tensor operations alone, so before the first step it builds, for
every stop string, a table over the whole vocabulary (where each token can sit inside the stop string): 3 to 8 s
for four stop strings of 63 characters on SmolLM2's 49,152 tokens, again for every new set of stop strings (a
server's requests). generate() reads the stopping criteria's answer on the host after every step anyway, to end
its loop, so `TailStopStringCriteria` makes the same decision on the text itself: each step it reads the window
of each row's last tokens to the host, cleans the tokens it has not seen yet, and looks for the stop strings there.

The decision is transformers', token for token (tests/generation/test_stop_strings.py compares them): a row stops
when a stop string ends inside its last token, that is when the stop string occurs in the last token's text
preceded by at most `len(stop) - 1` characters of the tokens before it. Those are transformers' own texts of the
tokens (`StopStringCriteria.clean_tokenizer_vocab`: bytes for byte-level and byte-fallback vocabularies, a stop
string then compared as UTF-8), read over the same window of the last `max(len(stop))` tokens; an id outside the
vocabulary ends the text before it, as in transformers. One difference: transformers refuses, before generating,
a stop string that no token's text can end (it could never match); here it is accepted and never matches.
"""

from collections.abc import Iterable, Sequence

import torch
from transformers import StoppingCriteria, StopStringCriteria
from transformers.tokenization_utils_base import PreTrainedTokenizerBase


# transformers' prefix for reading a token's text without the decoder's leading-space rules
# (`StopStringCriteria.clean_tokenizer_vocab`'s default).
STATIC_PREFIX = "abcdef"

Text = str | bytes


class TailStopStringCriteria(StoppingCriteria):
    """`StopStringCriteria`'s decision without its vocabulary-wide tables: construction reads the vocabulary's
    names once (no table per stop string), each step costs the length of the longest stop string per row.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop_strings: str | Iterable[str]) -> None:
        if isinstance(stop_strings, str):
            stop_strings = [stop_strings]
        self.stop_strings: tuple[str, ...] = tuple(stop_strings)
        self._tokenizer = tokenizer
        self._mode = StopStringCriteria._get_stop_string_matching_mode(tokenizer)
        self._stops: tuple[Text, ...] = StopStringCriteria._get_stop_strings_for_matching(
            self.stop_strings, self._mode
        )
        # The window transformers reads: one token per character (or byte) of the longest stop string.
        self.maximum_token_len = max(len(stop) for stop in self._stops)
        self._empty: Text = "" if self._mode is None else b""
        self._names = {index: name for name, index in tokenizer.get_vocab().items()}
        self._byte_decoder = StopStringCriteria._byte_level_decoder() if self._mode == "byte_level" else None
        self._prefix_names: list[str] | None = None
        self._texts: dict[int, Text | None] = {}

    def _text(self, index: int) -> Text | None:
        """A token's text as transformers cleans it (None: not in the vocabulary), computed once per token."""
        if index in self._texts:
            return self._texts[index]
        name = self._names.get(index)
        text = None
        if name is not None:
            text = StopStringCriteria._token_to_bytes(name, self._mode, self._byte_decoder)
            if text is None:
                if self._prefix_names is None:
                    prefix_ids = self._tokenizer(STATIC_PREFIX, add_special_tokens=False)["input_ids"]
                    self._prefix_names = [self._tokenizer._convert_id_to_token(i) for i in prefix_ids]
                text = self._tokenizer.convert_tokens_to_string(self._prefix_names + [name])
                text = text[text.index(STATIC_PREFIX) + len(STATIC_PREFIX) :]
                if self._mode is not None:
                    text = text.encode("utf-8")
        self._texts[index] = text
        return text

    def _row_stops(self, ids: Sequence[int]) -> bool:
        """Whether a stop string ends inside the last of `ids` (the row's window of tokens)."""
        if any(not stop for stop in self._stops):
            return True  # transformers: an empty stop string matches at every step
        last = self._text(ids[-1]) if ids else None
        if not last:
            return False  # no text (or an id outside the vocabulary) for a stop string to end in
        # The text before the last token, as far back as the longest stop string needs, stopped by an unknown id.
        pieces: list[Text] = []
        length = 0
        for index in reversed(ids[:-1]):
            if length >= self.maximum_token_len - 1:
                break
            piece = self._text(index)
            if piece is None:
                break
            pieces.append(piece)
            length += len(piece)
        before = self._empty.join(reversed(pieces))
        for stop in self._stops:
            # Any occurrence of the stop string in `tail` ends inside the last token: what precedes it is shorter.
            tail = before[max(0, len(before) - len(stop) + 1) :] + last
            if stop in tail:
                return True
        return False

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor | None, **kwargs) -> torch.BoolTensor:
        """One bool per row: True where a stop string ends inside the row's last token."""
        window = input_ids[:, -self.maximum_token_len :].tolist()
        return torch.tensor([self._row_stops(row) for row in window], dtype=torch.bool, device=input_ids.device)
