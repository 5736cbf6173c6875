"""Qwen3.5 and Qwen3-Next: hybrid models whose decoder layers are gated DeltaNet linear attention
(``models/deltanet.py``) or gated full attention, three to one by default.

Full-attention layers run over the placed pool like the GQA families' (q/k RMSNorm, partial
RoPE), with Qwen's output gate: ``q_proj`` emits each head's query and gate side by side, and the
attention output is multiplied by ``sigmoid(gate)`` before ``o_proj``. Their pool index is their
order among the full-attention layers; the linear layers' state-pool index likewise.
Checkpoints of the multimodal ``qwen3_5`` / ``qwen3_5_moe`` models are read through their text
config (``config.get_text_config()``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from torch_cp.attention.backend import AttentionGeometry
from torch_cp.mesh import KVHeadLayout
from torch_cp.models import deltanet
from torch_cp.models.gqa import gqa_geometry, head_dim_of, head_split_problems
from torch_cp.placement import ContextParallel
from torch_cp.state import LinearGeometry, StatePool
from torch_cp.state.pool import linear_head_problems
from torch_cp.tp import keep_in_features, keep_out_features

LAYER_TYPES = ("linear_attention", "full_attention")


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@dataclass(frozen=True)
class HybridFamily:
    """A hybrid family; see ``torch_cp.models.base.Family``. Beyond it: ``linear_classes``,
    ``attention_layers``, ``linear_geometry``, ``shard_linear`` and ``linear_forward``.

    Attributes:
        modeling: model type -> (modeling module, attention class, linear-attention class).
    """

    modeling: Mapping[str, tuple[str, str, str]]
    kind: str = "gqa"
    ropes: Mapping[str, Callable] = field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "ropes", {
            t: importlib.import_module(m).apply_rotary_pos_emb
            for t, (m, _, _) in self.modeling.items()})

    @property
    def model_types(self) -> tuple[str, ...]:
        return tuple(self.modeling)

    @property
    def attention_classes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(a for _, a, _ in self.modeling.values()))

    @property
    def linear_classes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(lin for _, _, lin in self.modeling.values()))

    def kv_heads(self, config) -> int:
        return text_config(config).num_key_value_heads

    def attention_layers(self, config) -> list[int]:
        """Decoder layer indices of the full-attention layers."""
        return [i for i, t in enumerate(text_config(config).layer_types) if t == "full_attention"]

    def problems(self, config, tp: int) -> list[str]:
        config = text_config(config)
        problems = []
        odd = sorted(set(config.layer_types) - set(LAYER_TYPES))
        if odd:
            problems.append(f"{config.model_type}: layer types {odd} are not supported (only "
                            f"{', '.join(LAYER_TYPES)})")
        return (problems + head_split_problems(config, tp)
                + linear_head_problems(config, tp))

    def geometry(self, config, tp: int, placement: ContextParallel) -> AttentionGeometry:
        return gqa_geometry(text_config(config), tp, placement)

    def linear_geometry(self, config, tp: int) -> LinearGeometry:
        return LinearGeometry.from_config(text_config(config), tp)

    def shard_attention(self, attn: nn.Module, tp_rank: int, tp: int,
                        layout: KVHeadLayout) -> None:
        """q_proj: this rank's heads' [query | gate] rows; k/v_proj: its KV heads; o_proj: its
        query heads' input columns."""
        d = head_dim_of(attn.config)
        q_heads = attn.config.num_attention_heads // tp
        kv = layout.heads_of(tp_rank)
        keep_out_features(attn.q_proj, slice(tp_rank * q_heads * 2 * d,
                                             (tp_rank + 1) * q_heads * 2 * d))
        keep_out_features(attn.k_proj, slice(kv.start * d, kv.stop * d))
        keep_out_features(attn.v_proj, slice(kv.start * d, kv.stop * d))
        keep_in_features(attn.o_proj, slice(tp_rank * q_heads * d, (tp_rank + 1) * q_heads * d))

    def shard_linear(self, mod: nn.Module, tp_rank: int, tp: int) -> None:
        deltanet.shard_linear(mod, tp_rank, tp)

    def forward(self, attn: nn.Module, x_nd: torch.Tensor, cos_nd: torch.Tensor,
                sin_nd: torch.Tensor, pool, plan) -> torch.Tensor:
        """x_nd [N, hidden] -> [N, hidden]; see ``Family.forward``."""
        n = x_nd.shape[0]
        d = head_dim_of(attn.config)
        q_gate, k, v = attn.cp_in(x_nd)  # q_proj, k_proj, v_proj as one GEMM
        q_nhd, gate_nhd = torch.chunk(q_gate.view(n, -1, 2 * d), 2, dim=-1)
        q_nhd = attn.q_norm(q_nhd)
        k_nhd = attn.k_norm(k.view(n, -1, d))
        v_nhd = v.view(n, -1, d)
        q_nhd, k_nhd = self.ropes[attn.config.model_type](q_nhd, k_nhd, cos_nd, sin_nd,
                                                          unsqueeze_dim=1)
        out_nhd = attn.cp_attention(q_nhd, k_nhd, v_nhd, pool, plan)
        return attn.o_proj(out_nhd.reshape(n, -1) * torch.sigmoid(gate_nhd.reshape(n, -1)))

    def linear_forward(self, mod: nn.Module, x_nd: torch.Tensor, state: StatePool,
                       plan) -> torch.Tensor:
        return deltanet.linear_forward(mod, x_nd, state, plan)


_QWEN35 = "transformers.models.qwen3_5.modeling_qwen3_5"
_QWEN35_MOE = "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"
_QWEN35_CLASSES = (_QWEN35, "Qwen3_5Attention", "Qwen3_5GatedDeltaNet")
_QWEN35_MOE_CLASSES = (_QWEN35_MOE, "Qwen3_5MoeAttention", "Qwen3_5MoeGatedDeltaNet")

FAMILY = HybridFamily(modeling={
    "qwen3_next": ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextAttention",
                   "Qwen3NextGatedDeltaNet"),
    "qwen3_5_text": _QWEN35_CLASSES,
    "qwen3_5": _QWEN35_CLASSES,
    "qwen3_5_moe_text": _QWEN35_MOE_CLASSES,
    "qwen3_5_moe": _QWEN35_MOE_CLASSES,
})
