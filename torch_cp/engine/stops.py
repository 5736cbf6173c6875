"""Stops of the serving API: its stop options read, and stop strings as transformers'
``StopStringCriteria``, made once and known by a number.

Making a criterion walks the tokenizer's whole vocabulary (0.5-1.3 s for 150k tokens) and the
result pickles to about 4 MB, while requests mostly share their stop strings. So a criterion is
made once per (tokenizer, strings), a submission carries only its number, and under torchrun a
criterion crosses from rank 0 to the other ranks once, with the first step that needs it. One
that no live request names is dropped once ``IDLE_KEPT`` others were used after it (made again,
under a new number, when a request names it again).
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from torch_cp.engine.checks import checked
from torch_cp.engine.requests import id_tuple


def stops_of(stop_token_ids, stop_strings, tokenizer, problems: list[str]
             ) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """A submission's stop token ids and stop strings as tuples (an int is one id, a str one
    string, as transformers takes them; None is none), each problem added to ``problems``."""
    ids = checked(problems, id_tuple, stop_token_ids, "stop_token_ids") or ()
    strings = _as_tuple(stop_strings, str)
    if (strings or stop_strings) and not isinstance(tokenizer, PreTrainedTokenizerBase):
        # StopStringCriteria reads the vocabulary through transformers' tokenizer API (a
        # ``tokenizers.Tokenizer`` has get_vocab but not that API: a TypeError at the step)
        problems.append("stop_strings need a tokenizer" + (
            "" if tokenizer is None else f", got a {type(tokenizer).__name__}")
            + " (a transformers one, as AutoTokenizer gives)")
    if strings is None or not all(isinstance(t, str) and t for t in strings):
        problems.append(f"stop_strings must be a non-empty str or such strs, got "
                        f"{stop_strings!r}")
        strings = ()
    return ids, strings


def _as_tuple(value, one: type) -> tuple | None:
    if value is None:
        return ()
    if isinstance(value, one):
        return (value,)
    try:
        return tuple(value)
    except TypeError:  # neither one nor a collection of them
        return None

# Criteria no live request names, kept for the next requests that name them (the ones used last).
IDLE_KEPT = 8


class StopStrings:
    """Criteria by number. Rank 0 numbers them (``number``), drops those no live request names
    beyond the ``IDLE_KEPT`` used last (``forget_idle``), and sends the other ranks what changed
    since (``unsent``: a criterion, or None for one dropped); every rank learns what rank 0 sent
    (``learn``) and looks them up by number."""

    def __init__(self) -> None:
        # (id(tokenizer), strings) -> (tokenizer, number): the tokenizer kept, so its id is not
        # reused while the entry lives
        self._numbers: dict[tuple, tuple[object, int]] = {}
        self._criteria: dict[int, object] = {}  # in the order of their last use
        self._unsent: dict[int, object | None] = {}
        self._next = 0  # numbers are never reused

    def number(self, tokenizer, strings: tuple[str, ...]) -> int:
        """The number of the criterion for ``strings`` under ``tokenizer``, made if new."""
        key = (id(tokenizer), strings)
        made = self._numbers.get(key)
        if made is None or made[0] is not tokenizer:  # an id reused by another tokenizer
            from transformers.generation.stopping_criteria import StopStringCriteria

            number, self._next = self._next, self._next + 1
            criterion = StopStringCriteria(tokenizer, list(strings))
            self._criteria[number] = self._unsent[number] = criterion
            made = self._numbers[key] = (tokenizer, number)
        else:
            self._criteria[made[1]] = self._criteria.pop(made[1])  # used last
        return made[1]

    def forget_idle(self, live: set[int]) -> None:
        """Drop the criteria no number in ``live`` names, but the ``IDLE_KEPT`` used last: a
        server whose requests bring their own stop strings would keep every one (each about
        4 MB for a 150k vocabulary) for the engine's life."""
        idle = [n for n in self._criteria if n not in live]
        for number in idle[:max(len(idle) - IDLE_KEPT, 0)]:
            del self._criteria[number]
            self._unsent[number] = None
        self._numbers = {k: v for k, v in self._numbers.items() if v[1] in self._criteria}

    def unsent(self) -> dict[int, object | None]:
        """What changed since the last call: to send with the next decisions."""
        unsent, self._unsent = self._unsent, {}
        return unsent

    def learn(self, changes: dict[int, object | None]) -> None:
        """Take rank 0's changes (on the other ranks, which number nothing themselves)."""
        for number, criterion in changes.items():
            if criterion is None:
                self._criteria.pop(number, None)
            else:
                self._criteria[number] = criterion
            self._next = max(self._next, number + 1)
        self._numbers = {k: v for k, v in self._numbers.items() if v[1] in self._criteria}

    def __len__(self) -> int:
        return len(self._criteria)

    def __getitem__(self, number: int):
        return self._criteria[number]
