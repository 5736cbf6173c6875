"""What ranks compare before a call (``torch_cp.agreement``): a digest of each argument that is
alike on ranks holding alike values, and unlike where the values differ anywhere. The gathers
themselves run over gloo ranks in engine/test_generate_multirank.py and
hf/test_from_pretrained.py."""

from __future__ import annotations

import numpy as np
import torch
from transformers import GenerationConfig

from torch_cp.agreement import DESCRIBED_DEPTH, described, fingerprint


def test_a_long_tensor_is_compared_by_every_element():
    """A tensor's repr elides its middle: two prompts differing only there share it."""
    a, b = torch.arange(5000), torch.arange(5000)
    b[2500] = -1
    assert repr(a) == repr(b)
    assert fingerprint(x=described(a)) != fingerprint(x=described(b))
    assert fingerprint(x=described(a)) == fingerprint(x=described(a.clone()))
    assert described(a.int()) != described(a), "the dtype counts"


def test_objects_are_compared_by_type_and_attributes_and_configs_by_value():
    """A streamer or logits processor holds an address in its repr, never alike on two ranks."""
    class Streamer:
        pass

    assert described(Streamer()) == described(Streamer()) == (
        "test_objects_are_compared_by_type_and_attributes_and_configs_by_value.<locals>.Streamer",
        {})
    assert described(GenerationConfig(max_new_tokens=3)) != described(
        GenerationConfig(max_new_tokens=4))
    n, ids = described({"n": np.int64(3), "ids": np.arange(3)}).values()
    assert n[:2] == ("int64", ()) and ids[:2] == ("int64", (3,))
    assert ids == described(np.arange(3)) != described(np.arange(1, 4))


def test_a_criterion_or_processor_with_other_settings_differs():
    """Helper 72: ranks passing MaxLengthCriteria(5) and (8) stopped at other steps (one rank
    hung in the partners' gather); SuppressTokensLogitsProcessor([0]) and ([97]) gave other
    tokens. Their settings are attributes (a tensor for the suppressed ids)."""
    from transformers import (
        LogitsProcessorList,
        MaxLengthCriteria,
        StoppingCriteriaList,
        SuppressTokensLogitsProcessor,
    )

    def stop(n):
        return described(StoppingCriteriaList([MaxLengthCriteria(max_length=n)]))

    def suppress(ids):
        return described(LogitsProcessorList([SuppressTokensLogitsProcessor(ids)]))
    assert stop(5) == stop(5) != stop(8)
    assert suppress([0]) == suppress([0]) != suppress([97])


def test_modules_and_tokenizers_are_described_by_type_alone():
    """Their attributes are weights and vocabularies: never hashed before a call."""
    from torch_cp.tiny import tiny_qwen3, tiny_tokenizer

    assert described(tiny_qwen3(seed=0)) == described(tiny_qwen3(seed=1)) == "Qwen3ForCausalLM"
    assert isinstance(described(tiny_tokenizer()), str)
    nested = {"a": [{"b": object()}]}
    for _ in range(10):  # objects within objects: a few levels, then the type's name
        holder = type("Holder", (), {})()
        holder.inner = nested
        nested = holder
    got, levels = described(nested), 0
    while isinstance(got, tuple):
        got, levels = got[1]["inner"], levels + 1
    assert (levels, got) == (DESCRIBED_DEPTH, "Holder")


def test_a_large_tensor_is_hashed_not_listed():
    """Helper 68: ``tolist`` of 8k x 4096 bf16 embeddings took 19 s; their bytes hash at once,
    alike wherever they live and unlike for one bit of difference."""
    x = torch.randn(8192, 4096, dtype=torch.bfloat16)
    y = x.clone()
    y.view(torch.int16)[4000, 17] ^= 1
    assert described(x) == described(x.clone()) != described(y)
    assert described(x.t())[1] == (4096, 8192) and described(x.t()) != described(x)


def test_configs_are_compared_without_what_ranks_load_apart():
    """The checkpoint's path, the dtype it was loaded in and the transformers version may differ
    between ranks that load one model, in nested configs too (helper 68); sizes may not."""
    from torch_cp.hf.validate import _public

    def config(path, dtype, layers):
        return {"_name_or_path": path, "dtype": dtype, "num_hidden_layers": layers,
                "id2label": {0: "a"}, "text_config": {"_name_or_path": path, "dtype": dtype,
                                                      "transformers_version": "5"}}
    assert _public(config("/a", "bfloat16", 2)) == _public(config("/b", "float32", 2))
    assert _public(config("/a", "bfloat16", 2)) != _public(config("/a", "bfloat16", 3))
