"""What ranks compare before a call (``torch_cp.agreement``): a digest of each argument that is
alike on ranks holding alike values, and unlike where the values differ anywhere. The gathers
themselves run over gloo ranks in engine/test_generate_multirank.py and
hf/test_from_pretrained.py."""

from __future__ import annotations

import numpy as np
import torch
from transformers import GenerationConfig

from torch_cp.agreement import described, fingerprint


def test_a_long_tensor_is_compared_by_every_element():
    """A tensor's repr elides its middle: two prompts differing only there share it."""
    a, b = torch.arange(5000), torch.arange(5000)
    b[2500] = -1
    assert repr(a) == repr(b)
    assert fingerprint(x=described(a)) != fingerprint(x=described(b))
    assert fingerprint(x=described(a)) == fingerprint(x=described(a.clone()))
    assert described(a.int()) != described(a), "the dtype counts"


def test_objects_are_compared_by_type_and_configs_by_value():
    """A streamer or logits processor holds an address in its repr, never alike on two ranks."""
    class Streamer:
        pass

    assert described(Streamer()) == described(Streamer()) == "test_objects_are_compared_by_" \
        "type_and_configs_by_value.<locals>.Streamer"
    assert described(GenerationConfig(max_new_tokens=3)) != described(
        GenerationConfig(max_new_tokens=4))
    assert described({"n": np.int64(3), "ids": np.arange(3)}) == {
        "n": ("int64", (), 3), "ids": ("int64", (3,), [0, 1, 2])}
