"""State checkpoints: where a hybrid model may reuse a cached prefix.

A linear-attention layer's state after token t sums every token before it, so a request can skip
a cached prefix only if it starts from the state the prefix left. A checkpoint is a copy of a
request's state (every linear layer, this rank's heads) taken right after a page boundary of its
prompt, kept in a state-pool slot of its own and keyed by the prefix-cache key of the page that
ends there (``page_keys``): equal keys mean equal tokens from the first one on, hence an equal
state. Like page ids the decisions use logical keys only, so every partner takes, keeps and
evicts the same checkpoints, each holding its own share of the state (its heads in TP mode, the
whole state in SP mode).

A fixed set of slots holds them; when all are taken, the least recently used checkpoint gives
its slot to the next.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence


class StateCheckpoints:
    """Which state-pool slots hold which checkpoints.

    Args:
        slots: the state-pool slots set aside for checkpoints (none of them a running
            request's).
    """

    def __init__(self, slots: Sequence[int]):
        self.slots = tuple(slots)
        self._free: deque[int] = deque(self.slots)
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slot_of

    def deepest(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` (a prompt's page keys from its first page) lead up to the last
        one with a checkpoint: 0 when none has one."""
        for depth in range(len(keys), 0, -1):
            if keys[depth - 1] in self._slot_of:
                return depth
        return 0

    def use(self, key: bytes) -> int:
        """The slot of ``key``'s checkpoint, marked most recently used."""
        self._slot_of.move_to_end(key)
        return self._slot_of[key]

    def take(self, key: bytes) -> int | None:
        """A slot for a new checkpoint at ``key`` (a free one, else the least recently used
        checkpoint's); None when ``key`` has one already (it is marked used) or there are no
        slots."""
        if key in self._slot_of:
            self._slot_of.move_to_end(key)
            return None
        if self._free:
            slot = self._free.popleft()
        elif self._slot_of:
            _, slot = self._slot_of.popitem(last=False)
        else:
            return None
        self._slot_of[key] = slot
        return slot

    def drop(self, key: bytes) -> None:
        """Forget ``key``'s checkpoint (its copy never ran); its slot is free again."""
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def held(self) -> dict[bytes, int]:
        """key -> slot of every checkpoint, least recently used first (tests)."""
        return dict(self._slot_of)
