"""MLA families (deepseek_v3, glm4_moe_lite): absorbed attention over the placed latent pool.

The pool stores, per token, the normalised latent ``ckv`` [kv_lora_rank] (after ``kv_a_layernorm``)
and the RoPE'd rope key ``kpe`` [qk_rope_head_dim]; K and V are never decompressed. ``kv_b_proj``
holds, per head h, ``W_UK[h]`` [qk_nope, R] and ``W_UV[h]`` [v_head_dim, R] (its rows are
``[k_nope | v]`` per head), so

    q_nope . k_nope = q_nope . (W_UK ckv) = (W_UK^T q_nope) . ckv
    sum_t p_t v_t   = W_UV (sum_t p_t ckv_t)

and attention runs as one latent KV head: query ``W_UK^T q_nope | q_pe`` [R + rope], keys
``ckv | kpe``, values ``ckv``; its output goes through ``W_UV`` and ``o_proj``. The softmax scale is
the module's own (``attn.scaling``: ``qk_head_dim ** -0.5`` with DeepSeek's YaRN mscale).
"""

from __future__ import annotations

import importlib
import sys

import torch
from torch import nn

from torch_cp.attention.backend import AttentionGeometry
from torch_cp.mesh import KVHeadLayout
from torch_cp.placement import ContextParallel
from torch_cp.tp import keep_in_features, keep_out_features


def _hf_module(model_type: str):
    """The transformers modeling module of ``model_type`` (its RoPE and mscale helpers)."""
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def softmax_scale(config) -> float:
    """The Hugging Face module's softmax scale: ``qk_head_dim ** -0.5`` (x mscale**2 under YaRN)."""
    qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    return _hf_module(config.model_type).yarn_apply_mscale(config.rope_parameters,
                                                           qk_head_dim ** (-0.5))


def _head_rows(heads: range, width: int) -> slice:
    """Rows of ``heads`` in a projection laid out as ``[head, width]``."""
    return slice(heads.start * width, heads.stop * width)


class MLAFamily:
    """``Family`` for Hugging Face MLA attention (see ``torch_cp.models.base.Family``)."""

    model_types = ("glm4_moe_lite", "deepseek_v3")
    kind = "mla"
    attention_classes = ("Glm4MoeLiteAttention", "DeepseekV3Attention")

    def kv_heads(self, config) -> int:
        return 1

    def problems(self, config, tp: int) -> list[str]:
        out = []
        if config.model_type not in self.model_types:
            out.append(f"model_type {config.model_type!r} is not an MLA family "
                       f"({', '.join(self.model_types)})")
        heads = config.num_attention_heads
        if tp < 1 or heads % tp != 0:
            out.append(f"{heads} attention heads do not split evenly over tp = {tp}")
        for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            if not getattr(config, name, 0) or getattr(config, name) < 1:
                out.append(f"MLA needs {name} >= 1, got {getattr(config, name, None)}")
        if getattr(config, "qk_nope_head_dim", None) is None or config.qk_nope_head_dim < 0:
            out.append(f"MLA needs qk_nope_head_dim >= 0, got "
                       f"{getattr(config, 'qk_nope_head_dim', None)}")
        rope = getattr(config, "qk_rope_head_dim", 0) or 0
        if rope % 2:
            out.append(f"qk_rope_head_dim must be even for RoPE, got {rope}")
        return out

    def geometry(self, config, tp: int, placement: ContextParallel) -> AttentionGeometry:
        q_heads = config.num_attention_heads // tp
        tp_mode = placement.size > 1 and placement.mode == "tp"
        return AttentionGeometry(
            kind="mla",
            q_heads=q_heads,
            kv_heads=1,
            head_dim=config.kv_lora_rank + config.qk_rope_head_dim,
            head_dim_v=config.kv_lora_rank,
            scale=softmax_scale(config),
            context_q_heads=placement.size * q_heads if tp_mode else q_heads,
            rope_dim=config.qk_rope_head_dim,
        )

    def shard_attention(self, attn: nn.Module, tp_rank: int, tp: int, layout: KVHeadLayout) -> None:
        """Keep this rank's query heads: rows of ``q_proj``/``q_b_proj`` and ``kv_b_proj``, input
        columns of ``o_proj`` (made row-parallel by the caller; its bias stays whole and is added
        once after the all-reduce). ``q_a_proj``, ``kv_a_proj_with_mqa`` and the norms stay
        replicated: every rank holds the one latent head (``layout`` is ``KVHeadLayout(1, tp)``).
        """
        if tp == 1:
            return
        per_rank = attn.num_heads // tp
        heads = range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
        q_linear = attn.q_proj if attn.q_proj is not None else attn.q_b_proj
        keep_out_features(q_linear, _head_rows(heads, attn.qk_head_dim))
        keep_out_features(attn.kv_b_proj,
                          _head_rows(heads, attn.qk_nope_head_dim + attn.v_head_dim))
        keep_in_features(attn.o_proj, _head_rows(heads, attn.v_head_dim))
        attn.num_heads = per_rank

    def forward(self, attn: nn.Module, x_nd: torch.Tensor, cos_nd: torch.Tensor,
                sin_nd: torch.Tensor, pool, plan) -> torch.Tensor:
        """Absorbed MLA of N packed tokens over ``pool`` (an ``MLAPool``) with ``plan``:
        projections, RoPE, placed latent attention, W_UV and ``o_proj``; x_nd [N, hidden] ->
        [N, hidden] (see ``Family.forward``)."""
        n = x_nd.shape[0]
        nope, rope, rank = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.kv_lora_rank
        q, ckv_kpe = attn.cp_in(x_nd)  # q_proj (or q_a_proj), kv_a_proj_with_mqa as one GEMM
        if attn.q_proj is None:
            q = attn.q_b_proj(attn.q_a_layernorm(q))
        q_nhd = q.view(n, -1, nope + rope)
        q_nope, q_pe = q_nhd.split([nope, rope], dim=-1)

        ckv, kpe = ckv_kpe.split([rank, rope], dim=-1)
        ckv_nr = attn.kv_a_layernorm(ckv)

        # The model's own RoPE (rotate_half or interleaved pairs), unsqueezed over heads; its
        # module is already imported (sys.modules, not importlib, which torch.compile cannot trace).
        hf = sys.modules[type(attn).__module__]
        rotary = (hf.apply_rotary_pos_emb_interleave if attn.config.rope_interleave
                  else hf.apply_rotary_pos_emb)
        q_pe, kpe_n1r = rotary(q_pe, kpe.unsqueeze(1), cos_nd, sin_nd, unsqueeze_dim=1)

        w = attn.kv_b_proj.weight.view(-1, nope + attn.v_head_dim, rank)  # [H, nope + v, R]
        w_uk, w_uv = w[:, :nope], w[:, nope:]
        q_latent = torch.einsum("nhd,hdr->nhr", q_nope, w_uk)
        q_nhk = torch.cat((q_latent, q_pe), dim=-1)  # [N, H, R + rope]

        o_nhr = attn.cp_attention(q_nhk, ckv_nr.contiguous(), kpe_n1r.squeeze(1).contiguous(),
                                  pool, plan)
        o_nhv = torch.einsum("nhr,hvr->nhv", o_nhr.to(w_uv.dtype), w_uv)
        return attn.o_proj(o_nhv.reshape(n, -1))


FAMILY = MLAFamily()
