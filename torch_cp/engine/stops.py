"""Stop strings of the serving API: transformers' ``StopStringCriteria``, made once and known by
a number.

Making a criterion walks the tokenizer's whole vocabulary (0.5-1.3 s for 150k tokens) and the
result pickles to about 4 MB, while requests mostly share their stop strings. So a criterion is
made once per (tokenizer, strings), a submission carries only its number, and under torchrun a
criterion crosses from rank 0 to the other ranks once, with the first step that needs it.
"""

from __future__ import annotations


class StopStrings:
    """Criteria by number. Rank 0 numbers them (``number``) and sends the ones the other ranks
    have not had (``unsent``); every rank learns what rank 0 sent (``learn``) and looks them up
    by number."""

    def __init__(self) -> None:
        # (id(tokenizer), strings) -> (tokenizer, number): the tokenizer kept, so its id is not
        # reused while the entry lives
        self._numbers: dict[tuple, tuple[object, int]] = {}
        self._criteria: dict[int, object] = {}
        self._unsent: dict[int, object] = {}

    def number(self, tokenizer, strings: tuple[str, ...]) -> int:
        """The number of the criterion for ``strings`` under ``tokenizer``, made if new."""
        key = (id(tokenizer), strings)
        made = self._numbers.get(key)
        if made is None or made[0] is not tokenizer:  # an id reused by another tokenizer
            from transformers.generation.stopping_criteria import StopStringCriteria

            number = max(self._criteria, default=-1) + 1  # past any learned from rank 0
            criterion = StopStringCriteria(tokenizer, list(strings))
            self._criteria[number] = self._unsent[number] = criterion
            made = self._numbers[key] = (tokenizer, number)
        return made[1]

    def unsent(self) -> dict[int, object]:
        """The criteria made since the last call: to send with the next decisions."""
        unsent, self._unsent = self._unsent, {}
        return unsent

    def learn(self, criteria: dict[int, object]) -> None:
        """Take rank 0's criteria (its numbers win over any this rank made itself)."""
        self._criteria.update(criteria)

    def __getitem__(self, number: int):
        return self._criteria[number]
