"""Token selection: greedy, temperature, top-k and top-p, identical on every rank.

Greedy picks the argmax where the logits are. Sampling runs on the host in float32 with one
``torch.Generator`` per request, seeded from the call's seed and the request's index. Every rank
therefore draws the same numbers for the same request whatever else shares its steps, and a run
repeats exactly under the same seed. The engine still broadcasts rank 0's tokens (see
``torch_cp.engine``), because the logits themselves may differ in the last bit between ranks (a
TP all-reduce or a merge in another order), and one flipped argmax would split the schedulers.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torch_cp.values import as_int

# Mixes the request index into the seed so requests draw independent streams.
_SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from a row's logits.

    Attributes:
        temperature: 0 for greedy (argmax); otherwise logits are divided by it before sampling
            (exactly however small it is: see ``scaled_logits``).
        top_k: keep the k most likely tokens (``None``: all).
        top_p: keep the smallest set of most likely tokens whose probability reaches p
            (``None``: all).
        seed: seeds each request's generator (``seed * 1_000_003 + request index``).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def __post_init__(self):
        problems = []
        if not _real(self.temperature) or not 0.0 <= self.temperature < math.inf:
            problems.append(f"temperature must be finite and >= 0, got {self.temperature!r}")
        top_k, seed = as_int(self.top_k), as_int(self.seed)  # NumPy's ints too
        if self.top_k is not None and (top_k is None or top_k < 1):
            problems.append(f"top_k must be a positive int or None, got {self.top_k!r}")
        if self.top_p is not None and (not _real(self.top_p) or not 0.0 < self.top_p <= 1.0):
            problems.append(f"top_p must be in (0, 1] or None, got {self.top_p!r}")
        if seed is None:
            problems.append(f"seed must be an int, got {self.seed!r}")
        if problems:
            raise ValueError("invalid sampling parameters: " + "; ".join(problems))
        # As Python's float and int: a Fraction passed the checks, then met a tensor (helper 79)
        for name, value in (("temperature", float(self.temperature)), ("top_k", top_k),
                            ("top_p", None if self.top_p is None else float(self.top_p)),
                            ("seed", seed)):
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self, request_index: int) -> torch.Generator:
        """The host generator of one request (any int seed: the request's seed is taken modulo
        2**63, what ``manual_seed`` holds)."""
        return torch.Generator().manual_seed((self.seed * _SEED_STRIDE + request_index) % 2**63)


def filter_logits(logits_bv: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Set the logits outside each row's top-k / top-p set to -inf ([B, V] float32)."""
    out = logits_bv
    if top_k is not None and top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[:, -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the top one stays.
        before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def scaled_logits(logits_bv: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` shifted so each row's largest is 0 ([B, V] float32): the same
    softmax, and never inf or NaN however small the temperature (the largest logit stays 0 and
    the others fall towards -inf, so the limit is greedy). The quotient is taken in float64:
    a temperature below float32's range would round to 0 there."""
    logits = logits_bv.to(torch.float64)
    return ((logits - logits.amax(dim=-1, keepdim=True)) / temperature).to(torch.float32)


def greedy_tokens(logits_bv: torch.Tensor) -> torch.Tensor:
    """[B] int64 argmax ids of [B, V] logits, on the logits' device (no host sync)."""
    return torch.argmax(logits_bv.detach().float(), dim=-1)


def sample(logits_bv: torch.Tensor, params: SamplingParams,
           generators: Sequence[torch.Generator] | None = None) -> torch.Tensor:
    """Choose one token per row.

    Args:
        logits_bv: [B, V] logits of each row's last token (any device and dtype).
        params: the sampling parameters.
        generators: one host generator per row; required unless ``params.greedy``.
    Returns:
        [B] int64 token ids on the host.
    """
    if params.greedy:  # on the logits' device: only B ids cross to the host, not [B, V] logits
        return greedy_tokens(logits_bv).cpu()
    logits = logits_bv.detach().to(device="cpu", dtype=torch.float32)
    if generators is None or len(generators) != logits.shape[0]:
        raise ValueError("sampling with temperature > 0 needs one generator per row")
    filtered = filter_logits(scaled_logits(logits, params.temperature), params.top_k,
                             params.top_p)
    probs = torch.softmax(filtered, dim=-1)
    return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])


def all_greedy(params: SamplingParams | Mapping[int, SamplingParams],
               requests: Sequence[int]) -> bool:
    """Whether every one of ``requests`` samples greedily (one ``SamplingParams`` for all or
    one per request; a request without parameters, ended since its step launched, greedily)."""
    if isinstance(params, SamplingParams):
        return params.greedy
    return all(params.get(r, _GREEDY).greedy for r in requests)


def sample_rows(logits_bv: torch.Tensor, params: SamplingParams | Mapping[int, SamplingParams],
                requests: Sequence[int], generators: Mapping[int, torch.Generator]
                ) -> torch.Tensor:
    """``sample`` for rows of ``requests``, with one ``SamplingParams`` for all or one per
    request (rows sharing parameters are sampled together). [B] int64 ids on the host. A
    request without parameters (one that ended after its step was launched ahead, whose token
    the caller drops) is sampled greedily."""
    if isinstance(params, SamplingParams):
        return sample(logits_bv, params, None if params.greedy else
                      [generators[r] for r in requests])
    out = torch.empty(len(requests), dtype=torch.int64)
    groups: dict[SamplingParams, list[int]] = {}
    for b, r in enumerate(requests):
        groups.setdefault(params.get(r, _GREEDY), []).append(b)
    for p, rows in groups.items():
        index = torch.tensor(rows)
        picked = logits_bv.index_select(0, index.to(logits_bv.device))
        out[index] = sample(picked, p, None if p.greedy else
                            [generators[requests[b]] for b in rows])
    return out


def broadcast_from_rank0(tokens: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``tokens`` on every rank: on their device under NCCL (stream-ordered, no host
    sync), else on the host."""
    t = tokens if dist.get_backend() == "nccl" else tokens.cpu()
    dist.broadcast(t, src=0)
    return t


def _real(value) -> bool:
    """A real number (Python's or NumPy's), not a bool (whose True would pass as 1)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


_GREEDY = SamplingParams()  # rows of requests that ended since their step launched
