"""Prompts as users hold them -> token-id lists (``normalize_prompts``).

A padded batch is taken apart by its attention mask exactly as Hugging Face reads it (1: a real
token, 0: padding): each prompt is its unmasked ids in order, so left and right padding give the
same prompts, and ``generate`` sees no padding at all (requests are packed, never padded).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence

import torch

from torch_cp.values import as_int

Prompt = Sequence[int] | torch.Tensor | str


def _tensor_like(x):
    """A NumPy array (``return_tensors="np"``) as a tensor; anything else unchanged."""
    if hasattr(x, "__array__") and hasattr(x, "ndim") and not isinstance(x, torch.Tensor):
        return torch.as_tensor(x)
    return x


def token_ids_of(prompt) -> list[int] | None:
    """``prompt``'s token ids as ints (``as_int`` of each), or None when it is not a sequence
    of them (a str, floats, bools: not token ids)."""
    if isinstance(prompt, (str, bytes)) or getattr(prompt, "dtype", None) == torch.bool:
        return None
    try:
        ids = [as_int(t) for t in prompt]
    except TypeError:
        return None
    return None if None in ids else ids


def token_prompts(prompts) -> list[list[int]]:
    """``prompts`` given as token-id lists (``Engine.run_tokens``) as lists of ints; ValueError
    naming every prompt that is not one (``token_ids_of``)."""
    if isinstance(prompts, (str, bytes, Mapping)) or not hasattr(prompts, "__iter__"):
        raise ValueError(f"invalid prompts: prompts must be a list of token-id lists, got "
                         f"{type(prompts).__name__}")
    ids = [token_ids_of(p) for p in prompts]
    bad = [i for i, p in enumerate(ids) if p is None]
    if bad:
        raise ValueError(f"invalid prompts: prompt{'s' if len(bad) > 1 else ''} {_shown(bad)}: "
                         f"not a sequence of token ids (ints)")
    return ids


def _is_chat(x) -> bool:
    """A conversation: a non-empty list of messages (mappings with a ``role``)."""
    return (isinstance(x, Sequence) and not isinstance(x, str) and len(x) > 0
            and all(isinstance(m, Mapping) and "role" in m for m in x))


def _is_token_row(x) -> bool:
    x = _tensor_like(x)  # a NumPy row too (helper 75: a batch of them skipped the pad check)
    if isinstance(x, torch.Tensor):
        return x.dim() == 1
    return isinstance(x, Sequence) and not isinstance(x, str) and token_ids_of(x) is not None


def _shown(indices: list[int]) -> str:
    return ", ".join(map(str, indices[:8])) + (", ..." if len(indices) > 8 else "")


def pad_token_ids(model, tokenizer=None) -> frozenset[int]:
    """The pad ids that the model's config, its generation config and ``tokenizer`` name."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = (getattr(text, "pad_token_id", None), getattr(config, "pad_token_id", None),
             getattr(getattr(model, "generation_config", None), "pad_token_id", None),
             getattr(tokenizer, "pad_token_id", None))
    ids = set()
    for pad in found:
        if isinstance(pad, int):
            ids.add(pad)
        elif isinstance(pad, Sequence):
            ids.update(t for t in pad if isinstance(t, int))
    return frozenset(ids)


def normalize_prompts(prompts, tokenizer=None, attention_mask=None,
                      pad_token_ids: frozenset[int] | Sequence[int] = ()) -> list[list[int]]:
    """Token-id lists (one per prompt) from the forms users hold prompts in.

    Forms (L: a prompt's tokens, B: prompts in the batch):

    - token ids: a list of ints or a 1-D integer tensor ``[L]`` (one prompt), or a batch of
      them (ragged lists are fine);
    - strings (one, or a list), encoded by ``tokenizer`` without special tokens;
    - a chat: a list of messages (``{"role": ..., "content": ...}``), or a list of such
      conversations, rendered by ``tokenizer.apply_chat_template(...,
      add_generation_prompt=True)``;
    - a padded batch with its mask: a ``BatchEncoding`` or dict with ``input_ids`` and
      ``attention_mask`` (lists, tensors or NumPy arrays, ``[L]`` or ``[B, L]``, left or right
      padded), or ``input_ids`` with ``attention_mask=`` of the same shape. Each prompt is
      exactly its ids where the mask is 1.

    A 2-D tensor without a mask, or two or more token lists of one length, whose rows start or
    end with a pad id (``pad_token_ids``: see ``pad_token_ids()``) is refused: that looks like a
    padded batch whose padding would be taken as prompt. An empty list inside the batch stays
    empty (the engine reports it as a bad request).

    Raises:
        ValueError: naming every problem found (strings or chats without a tokenizer, a chat
            without a chat template, a mask that does not fit, a padded batch without its
            mask, ...).
    """
    problems: list[str] = []
    if isinstance(prompts, Mapping):
        if "input_ids" not in prompts:
            what = "a single chat message: a chat is a list of messages" if "role" in prompts \
                else f"a mapping without 'input_ids' (keys: {sorted(map(str, prompts))})"
            raise ValueError(f"invalid prompts: {what}")
        mask = prompts.get("attention_mask")
        if mask is not None and attention_mask is not None:
            raise ValueError("invalid prompts: attention_mask given twice (in the encoding and "
                             "as attention_mask=)")
        attention_mask = mask if mask is not None else attention_mask
        prompts = prompts["input_ids"]
    prompts, attention_mask = _tensor_like(prompts), _tensor_like(attention_mask)
    if attention_mask is not None:
        out = _unmasked(prompts, attention_mask, problems)
    else:
        out = _encoded(_batch(prompts, problems), tokenizer, pad_token_ids, problems)
        if not problems:
            problems += _padding_problems(prompts, out, frozenset(pad_token_ids))
    if problems:
        raise ValueError("invalid prompts: " + "; ".join(problems))
    return out


def _batch(prompts, problems: list[str]) -> list:
    """The batch as a list of single prompts (one prompt alone is a batch of one)."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() in (1, 2):
            return [prompts] if prompts.dim() == 1 else list(prompts)
        problems.append(f"a tensor of prompts must be [L] or [B, L], got {tuple(prompts.shape)}")
        return []
    if isinstance(prompts, str) or _is_chat(prompts):
        return [prompts]
    if isinstance(prompts, Sequence) and len(prompts) > 0 and token_ids_of(prompts) is not None:
        return [prompts]
    try:
        return list(prompts)
    except TypeError:
        problems.append(f"prompts must be token ids, strings, chats or an encoding, got "
                        f"{type(prompts).__name__}")
        return []


def _encoded(batch: list, tokenizer, pad_ids, problems: list[str]) -> list[list[int]]:
    out, bad = [], {}  # bad: problem -> indices of the prompts that have it
    for i, p in enumerate(batch):
        p, ids, why = _tensor_like(p), None, None
        if isinstance(p, str):
            if tokenizer is None:
                why = "a string needs tokenizer= to encode it"
            else:
                ids, why = _tokenized(lambda text: list(tokenizer(
                    text, add_special_tokens=False)["input_ids"]), p)
        elif _is_chat(p):
            if tokenizer is None:
                why = "a chat needs tokenizer= (one with a chat template) to render it"
            elif not getattr(tokenizer, "chat_template", None):
                why = ("a chat needs a tokenizer with a chat template, and this one has none: "
                       "set tokenizer.chat_template, or pass text or token ids")
            else:
                ids, why = _tokenized(lambda chat: token_ids_of(tokenizer.apply_chat_template(
                    list(chat), add_generation_prompt=True, tokenize=True,
                    return_dict=True)["input_ids"]), p)
        elif isinstance(p, Mapping) and "input_ids" in p:
            try:
                rows = normalize_prompts(p, tokenizer, pad_token_ids=pad_ids)
            except ValueError as e:
                why = f"an invalid encoding ({e})"
            else:
                ids = rows[0] if len(rows) == 1 else None
                why = None if ids is not None else "an encoding of more than one prompt in a batch"
        elif isinstance(p, torch.Tensor):
            if p.dim() != 1 or p.is_floating_point() or p.is_complex() or p.dtype == torch.bool:
                why = "a tensor prompt must be 1-D integer token ids [L]"
            else:
                ids = p.tolist()
        elif isinstance(p, Mapping):
            why = "a single message or mapping: a chat is a list of messages"
        else:
            ids = token_ids_of(p) if isinstance(p, Sequence) else None
            why = None if ids is not None else \
                "neither token ids, a string, a chat nor an encoding"
        if why:
            bad.setdefault(why, []).append(i)
        out.append(ids)
    problems += [f"prompt{'s' if len(ix) > 1 else ''} {_shown(ix)}: {why}"
                 for why, ix in bad.items()]
    return out


def _tokenized(encode, prompt) -> tuple[list[int] | None, str | None]:
    """``encode(prompt)``'s token ids, or why not: a tokenizer or chat template may raise
    anything, and the prompt's index is named beside the other prompts' problems (helper 87)."""
    try:
        return encode(prompt), None
    except Exception as e:
        return None, f"the tokenizer raised {type(e).__name__}: {e}"


def _rows(x) -> tuple[list | None, int, str]:
    """(rows, dims, shape) of input_ids or a mask given as a tensor or (nested) lists."""
    if isinstance(x, torch.Tensor):
        rows = [x.tolist()] if x.dim() == 1 else x.tolist() if x.dim() == 2 else None
        return rows, x.dim(), str(tuple(x.shape))
    if isinstance(x, Sequence) and not isinstance(x, str):
        if all(isinstance(r, Sequence) and not isinstance(r, str) for r in x) and len(x) > 0:
            lens = [len(r) for r in x]
            return [list(r) for r in x], 2, (f"({len(x)}, {lens[0]})" if len(set(lens)) == 1
                                             else f"{len(x)} rows of lengths {lens}")
        return [list(x)], 1, f"({len(x)},)"
    return None, 0, type(x).__name__


def _unmasked(ids, mask, problems: list[str]) -> list[list[int]]:
    """Each row's ids where ``mask`` is 1, after checking that the two fit."""
    if isinstance(ids, torch.Tensor) and (ids.is_floating_point() or ids.is_complex()):
        problems.append(f"input_ids must be integer token ids, got {ids.dtype}")
    id_rows, id_dims, id_shape = _rows(ids)
    mask_rows, mask_dims, mask_shape = _rows(mask)
    if id_rows is None or any(token_ids_of(r) is None for r in id_rows):
        problems.append(f"with attention_mask, input_ids must be token ids [L] or [B, L], got "
                        f"{id_shape}")
        return []
    if mask_rows is None or id_dims != mask_dims or [len(r) for r in id_rows] != [
            len(r) for r in mask_rows]:
        problems.append(f"attention_mask of shape {mask_shape} does not match input_ids of "
                        f"shape {id_shape}")
        return []
    values = {v for r in mask_rows for v in r}
    if not values <= {0, 1}:
        problems.append(f"attention_mask must hold 1 for real tokens and 0 for padding (Hugging "
                        f"Face's convention), got values {sorted(values, key=str)[:6]}")
        return []
    return [[operator.index(t) for t, m in zip(r, mr) if m] for r, mr in zip(id_rows, mask_rows)]


def _padding_problems(prompts, out: list[list[int]], pad_ids: frozenset[int]) -> list[str]:
    """A rectangular batch of token ids without a mask whose rows start or end with a pad id."""
    if not pad_ids:
        return []
    prompts = _tensor_like(prompts)
    if isinstance(prompts, torch.Tensor):
        rectangular = prompts.dim() == 2
    else:
        rectangular = (isinstance(prompts, Sequence) and len(prompts) >= 2
                       and all(_is_token_row(p) for p in prompts)
                       and len({len(p) for p in prompts}) == 1)
    padded = [i for i, row in enumerate(out) if rectangular and row
              and (row[0] in pad_ids or row[-1] in pad_ids)]
    if not padded:
        return []
    return [f"prompts {_shown(padded)} of a batch without attention_mask start or end with the "
            f"pad token id {sorted(pad_ids)}: the padding would be taken as prompt; pass the "
            f"tokenizer's whole output (input_ids with attention_mask), or attention_mask="]
