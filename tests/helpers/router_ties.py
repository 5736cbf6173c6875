"""MoE routers at a near-tie: where a bf16 MoE model computed in another order (TP sums, another
attention kernel, grouped experts, rows packed into other batches) may pick another expert."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from gpu_models import near_tie


def gates(model) -> list[torch.nn.Module]:
    return [m.gate for m in model.modules()
            if isinstance(getattr(m, "experts", None), torch.nn.Module)]


def choice_scores(gate, h_td: torch.Tensor) -> torch.Tensor:
    """[T, experts]: what ``gate`` ranks experts by (sigmoid plus the correction bias for GLM and
    DeepSeek routers; the logits, whose softmax keeps their order, for Qwen's)."""
    logits = F.linear(h_td.float(), gate.weight.float())
    bias = getattr(gate, "e_score_correction_bias", None)
    return logits if bias is None else logits.sigmoid() + bias.float()


def _near_ties(gate, args, k: int) -> list[tuple[int, int, int]]:
    """(position, k-th expert, (k+1)-th expert) of every token of a ``gate`` call whose two
    scores are within ``near_tie`` of each other (against its largest score there)."""
    scores = choice_scores(gate, args[0].reshape(-1, gate.weight.shape[-1]))
    top, experts = scores.sort(-1, descending=True)
    return [(p, experts[p, k - 1].item(), experts[p, k].item()) for p in range(scores.shape[0])
            if near_tie((top[p, k - 1] - top[p, k]).item(), top[p].abs().max().item())]


def _ties(model, ids: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """Every (gate, position, k-th expert, (k+1)-th expert) of ``ids`` [1, T] at a near-tie."""
    k = model.config.get_text_config().num_experts_per_tok
    found = []

    def record(index):
        def hook(gate, args, _out):
            found.extend((index, *tie) for tie in _near_ties(gate, args, k))
        return hook

    with _hooked(model, record):
        model(ids)
    return found


class tied_positions:
    """Context manager: the positions of the token batch that ``model``'s routers see inside it
    (``[-1, hidden]`` rows of every gate call) where a router's k-th and (k+1)-th choices are
    within ``near_tie``: there a computation in another order (a compiled layer) may route the
    token to another expert. ``positions`` is filled on exit."""

    def __init__(self, model):
        self.model, self.positions = model, set()
        # A dense model has no gate to hook: no position is ever at a router tie.
        self.k = getattr(model.config.get_text_config(), "num_experts_per_tok", None)

    def __enter__(self):
        def make(_index):
            def hook(gate, args, _out):
                self.positions.update(p for p, _, _ in _near_ties(gate, args, self.k))
            return hook

        self.hooked = _hooked(self.model, make)
        return self

    def __exit__(self, *exc):
        self.hooked.__exit__(*exc)


class _hooked:
    def __init__(self, model, make_hook):
        self.handles = [g.register_forward_hook(make_hook(i)) for i, g in enumerate(gates(model))]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def _flipped_logits(model, ids, ties) -> torch.Tensor | None:
    """The last position's logits with near-ties of ``_ties`` decided the other way: at each, the
    hidden state the gate reads nudged along (w_b - w_a), just enough that the gate picks expert
    b over a, everything else as computed. None when a tie is no longer a near-tie where it is
    flipped (an earlier flip moved it away): only near-ties are decided the other way."""

    class Unflippable(Exception):
        pass

    def make(index):
        def hook(gate, args, out):
            mine = [t for t in ties if t[0] == index]
            if not mine:
                return None
            h = args[0].reshape(-1, gate.weight.shape[-1])
            for _, p, a, b in mine:
                scores = choice_scores(gate, h[p:p + 1])[0]
                if not near_tie(abs(scores[a] - scores[b]).item(), scores.abs().max().item()):
                    raise Unflippable
                direction = (gate.weight[b] - gate.weight[a]).to(h.dtype)
                for step in range(1, 40):
                    row = gate.forward(h[p:p + 1] + 2.0 ** (step - 30) * direction)
                    picked = row[-1][0].tolist()
                    if b in picked and a not in picked:
                        break
                else:
                    raise Unflippable
                out = tuple(torch.cat([o[:p], r, o[p + 1:]]) for o, r in zip(out, row))
            return out
        return hook

    try:
        with _hooked(model, make):
            return model(ids).logits[0, -1].float()
    except Unflippable:
        return None


@torch.inference_mode()
def router_flip_explains(model, ids: torch.Tensor, token: int, most: int = 2) -> bool:
    """Whether up to ``most`` expert choices the unpatched ``model`` makes at near-ties, anywhere
    in ``ids`` [1, T] (a flip at an earlier position reaches the last one through the KV and a
    hybrid's recurrent state), made the other way, make ``token`` its greedy next token (or
    within ``near_tie`` of it). Two, because a rounding that moves one router past a tie moves
    a second tie in the same step as easily (run 54: qwen3_moe's split at a 0.44 gap of 6.4,
    seen with grouped_mm over two GPUs in run 38 and with the fused experts on one). A split
    that no such flips explain is a fault: a wrong state, page or expert changes far more."""
    ties = _ties(model, ids)
    for n in range(1, most + 1):
        for chosen in itertools.combinations(ties, n):
            logits = _flipped_logits(model, ids, chosen)
            if logits is None:  # one near-tie alone always flips; a pair may not stay one
                assert n > 1, f"could not decide the near-tie {chosen} the other way"
                continue
            best = logits.max().item()
            if near_tie(best - logits[token].item(), abs(best)):
                return True
    return False
