"""Shared logic of the GQA families (Qwen2/3, Qwen3-MoE, GLM, GLM-4, GLM-4-MoE).

Their attention modules share one structure: ``q_proj``/``k_proj``/``v_proj`` (with or without
bias), optional per-head RMSNorms ``q_norm``/``k_norm``, RoPE over the first ``rotary_dim`` channels
of each head, attention and ``o_proj``. They differ only in the RoPE function (GLM and GLM-4 rotate
interleaved channel pairs) and in whether the norms exist, so the patched forward calls the RoPE
function of the model type's own Hugging Face modeling module and applies the norms the module has.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from torch_cp.attention.backend import AttentionGeometry
from torch_cp.layers import forward_source
from torch_cp.mesh import KVHeadLayout, kv_head_replicas
from torch_cp.placement import ContextParallel
from torch_cp.tp import keep_in_features, keep_out_features


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_problems(config) -> list[str]:
    """Sliding-window layers attend a window, not the whole pool: torch_cp does not run them.
    Where the config lists ``layer_types``, they alone say which layers slide (transformers reads
    ``sliding_window`` only for a "sliding_attention" layer: a Qwen2/3 config with
    ``use_sliding_window`` but ``max_window_layers >= num_hidden_layers`` slides nowhere)."""
    types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in types) if types else (
            getattr(config, "sliding_window", None) is not None):
        return [f"{config.model_type}: sliding-window attention layers are not supported "
                f"(use_sliding_window must be False, layer_types all 'full_attention')"]
    return []


def head_split_problems(config, tp: int) -> list[str]:
    """Query heads that do not split over ``tp``, KV heads that neither split nor replicate."""
    problems = []
    heads = config.num_attention_heads
    if heads % tp != 0:
        problems.append(f"{heads} query heads do not split evenly over tp = {tp}")
    try:
        kv_head_replicas(config.num_key_value_heads, tp)
    except ValueError as e:
        problems.append(str(e))
    return problems


def gqa_geometry(config, tp: int, placement: ContextParallel) -> AttentionGeometry:
    """Per-rank GQA attention shapes of ``config`` split over ``tp`` ranks (TP mode: the context
    kernel sees every partner's query heads)."""
    q_heads = config.num_attention_heads // tp
    layout = kv_head_replicas(config.num_key_value_heads, tp)
    head_dim = head_dim_of(config)
    tp_mode = placement.size > 1 and placement.mode == "tp"
    return AttentionGeometry(
        kind="gqa", q_heads=q_heads, kv_heads=layout.heads_per_rank, head_dim=head_dim,
        head_dim_v=head_dim, scale=head_dim**-0.5,
        context_q_heads=q_heads * placement.size if tp_mode else q_heads)


_PLAIN_RMS_NORM = forward_source(Qwen3RMSNorm)


def plain_rms_norms(module) -> frozenset[type]:
    """The RMSNorm classes of a modeling module whose forward is Qwen3's (float32, times the
    rsqrt of the mean of squares, rounded, times the weight): what ``rotate_and_write`` runs."""
    return frozenset(cls for cls in vars(module).values() if isinstance(cls, type)
                     and issubclass(cls, nn.Module) and cls.__name__.endswith("RMSNorm")
                     and forward_source(cls) == _PLAIN_RMS_NORM)


@dataclass(frozen=True)
class GQAFamily:
    """A GQA family; see ``torch_cp.models.base.Family``.

    Attributes:
        modeling: model type -> (Hugging Face modeling module, attention class name). The patched
            forward uses that module's ``apply_rotary_pos_emb``, so RoPE matches it exactly.
        rotate_halves: the model types whose RoPE is ``rotate_half`` over the first rotary
            dims, the rest passed through: the pool's one kernel runs their norms and RoPE
            (``GQAPool.rotate_and_write``) where it can and their q/k norms are ``plain_norms``.
        ropes: model type -> that RoPE function (resolved once, so the forward stays traceable).
        plain_norms: the RMSNorm classes of those types' modeling modules that the kernel runs
            (``plain_rms_norms``; found once: the forward's trace cannot read source).
    """

    modeling: Mapping[str, tuple[str, str]]
    rotate_halves: frozenset[str] = frozenset()
    kind: Literal["gqa", "mla"] = "gqa"
    ropes: Mapping[str, Callable] = field(init=False, repr=False)
    plain_norms: frozenset[type] = field(init=False, repr=False)

    def __post_init__(self):
        modules = {t: importlib.import_module(m) for t, (m, _) in self.modeling.items()}
        object.__setattr__(self, "ropes", {t: m.apply_rotary_pos_emb for t, m in modules.items()})
        object.__setattr__(self, "plain_norms", frozenset().union(
            *(plain_rms_norms(modules[t]) for t in self.rotate_halves)))

    def norms_for_kernel(self, attn: nn.Module, dtype: torch.dtype
                         ) -> tuple[torch.Tensor | None, torch.Tensor | None, float] | None:
        """(q weight, k weight, eps) of ``attn``'s q/k norms for ``rotate_and_write`` on
        projections of ``dtype``: (None, None, 0.0) without norms; None where the kernel does
        not run this model's norms and RoPE (a weight of another dtype promotes the norm's
        output)."""
        if attn.config.model_type not in self.rotate_halves:
            return None
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if q_norm is None and k_norm is None:
            return None, None, 0.0
        if (type(q_norm) not in self.plain_norms or type(k_norm) not in self.plain_norms
                or q_norm.variance_epsilon != k_norm.variance_epsilon
                or not q_norm.weight.dtype == k_norm.weight.dtype == dtype):
            return None
        return q_norm.weight, k_norm.weight, float(q_norm.variance_epsilon)

    @property
    def model_types(self) -> tuple[str, ...]:
        return tuple(self.modeling)

    @property
    def attention_classes(self) -> tuple[str, ...]:
        return tuple(cls for _, cls in self.modeling.values())

    def kv_heads(self, config) -> int:
        return config.num_key_value_heads

    def problems(self, config, tp: int) -> list[str]:
        return sliding_window_problems(config) + head_split_problems(config, tp)

    def geometry(self, config, tp: int, placement: ContextParallel) -> AttentionGeometry:
        return gqa_geometry(config, tp, placement)

    def shard_attention(self, attn: nn.Module, tp_rank: int, tp: int,
                        layout: KVHeadLayout) -> None:
        """q_proj: this rank's contiguous query heads; k_proj/v_proj: the KV heads ``layout``
        gives it; o_proj: the input columns of its query heads (made row-parallel by the caller)."""
        d = head_dim_of(attn.config)
        q_heads = attn.config.num_attention_heads // tp
        q_cols = slice(tp_rank * q_heads * d, (tp_rank + 1) * q_heads * d)
        kv = layout.heads_of(tp_rank)
        kv_cols = slice(kv.start * d, kv.stop * d)
        keep_out_features(attn.q_proj, q_cols)
        keep_out_features(attn.k_proj, kv_cols)
        keep_out_features(attn.v_proj, kv_cols)
        keep_in_features(attn.o_proj, q_cols)

    def forward(self, attn: nn.Module, x_nd: torch.Tensor, cos_nd: torch.Tensor,
                sin_nd: torch.Tensor, pool, plan) -> torch.Tensor:
        """x_nd [N, hidden] -> [N, hidden]; see ``Family.forward``."""
        n = x_nd.shape[0]
        d = head_dim_of(attn.config)
        q, k, v = attn.cp_in(x_nd)  # q_proj, k_proj, v_proj as one GEMM (fused_linear.py)
        q_nhd, k_nhd, v_nhd = q.view(n, -1, d), k.view(n, -1, d), v.view(n, -1, d)
        norms = self.norms_for_kernel(attn, q_nhd.dtype)
        written = norms is not None and pool.rotates(q_nhd, cos_nd)
        if written:  # the norms, RoPE and the pool write in one kernel
            q_nhd, k_nhd = pool.rotate_and_write(attn.cp_attention.layer_idx, q_nhd, k_nhd, v_nhd,
                                                 *norms, cos_nd, sin_nd, plan.write_index)
        else:
            if getattr(attn, "q_norm", None) is not None:
                q_nhd, k_nhd = attn.q_norm(q_nhd), attn.k_norm(k_nhd)
            rope = self.ropes[attn.config.model_type]
            q_nhd, k_nhd = rope(q_nhd, k_nhd, cos_nd, sin_nd, unsqueeze_dim=1)
        out_nhd = attn.cp_attention(q_nhd, k_nhd, v_nhd, pool, plan, written=written)
        return attn.o_proj(out_nhd.reshape(n, -1))
