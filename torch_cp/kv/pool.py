"""Placed paged KV pools: GQA in FlashInfer's NHD layout and the MLA latent pool.

Physical page ids equal logical page ids; one extra page at index ``num_pages`` is the sink page.
Each page holds ``page_size // P`` slots (see ``torch_cp.placement``).
"""

from __future__ import annotations

import functools
import importlib

import torch

from torch_cp.placement import ContextParallel


class GQAPool:
    """K/V of every layer: ``kv[layer]`` is [num_pages + 1, 2, page_size // P, kv_heads, head_dim].

    Args:
        num_layers, num_pages: layers and logical pages (the sink page is added).
        page_size: logical page size, a multiple of P.
        kv_heads: KV heads this rank holds; head_dim: their size.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_heads: int,
                 head_dim: int, placement: ContextParallel, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.placement = placement
        self.page_size = page_size
        self.local_page_size = placement.local_page_size(page_size)
        self.num_pages = num_pages
        self.sink_page = num_pages
        self.kv = torch.zeros(num_layers, num_pages + 1, 2, self.local_page_size, kv_heads,
                              head_dim, dtype=dtype, device=device)
        # Imported on first GPU use (or for a test's interpreter); None where it cannot import.
        self.rotate_kernel = (_kernel("norm_rope_write") if self.kv.is_cuda or ROTATE_IN_INTERPRETER
                              else None)

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every layer's pool tensors: ``[kv]``."""
        return [self.kv]

    def layer(self, layer_idx: int) -> torch.Tensor:
        return self.kv[layer_idx]

    def write(self, layer_idx: int, k_nhd: torch.Tensor, v_nhd: torch.Tensor,
              write_index: torch.Tensor) -> None:
        """Store new tokens' ``k_nhd``/``v_nhd`` [N, kv_heads, head_dim] at flat physical slots."""
        write_layer(self.tensors, k_nhd, v_nhd, write_index, layer_idx)

    def rotates(self, q_nhd: torch.Tensor, cos_nr: torch.Tensor) -> bool:
        """Whether ``rotate_and_write`` runs its one kernel here: turned on
        (``ROTATE_IN_ONE_KERNEL``), the pool on CUDA with the kernel importable (or in Triton's
        interpreter where a test asks, ``ROTATE_IN_INTERPRETER``), and the queries, RoPE's
        tables and the pool in one dtype."""
        return (ROTATE_IN_ONE_KERNEL and self.rotate_kernel is not None
                and (self.kv.is_cuda or ROTATE_IN_INTERPRETER)
                and q_nhd.dtype == cos_nr.dtype == self.kv.dtype)

    def rotate_and_write(self, layer_idx: int, q_nhd: torch.Tensor, k_nhd: torch.Tensor,
                         v_nhd: torch.Tensor, q_weight: torch.Tensor | None,
                         k_weight: torch.Tensor | None, eps: float, cos_nr: torch.Tensor,
                         sin_nr: torch.Tensor, write_index: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """New tokens' queries and keys through their RMSNorms (``q_weight``/``k_weight`` [D],
        or None) and rotate-half RoPE over ``cos_nr``'s dims, the keys and ``v_nhd`` stored at
        flat physical slots; returns the normed, rotated q and k. One kernel
        (``rotate_kernel``); only where ``rotates`` says."""
        if torch.compiler.is_compiling():
            return rotate_and_write(self.tensors, q_nhd, k_nhd, v_nhd, q_weight, k_weight, eps,
                                   cos_nr, sin_nr, write_index, layer_idx)
        return self.rotate_kernel(q_nhd, k_nhd, v_nhd, q_weight, k_weight, eps, cos_nr, sin_nr,
                                  self.kv[layer_idx], write_index)

    @property
    def bytes(self) -> int:
        return _bytes(self.tensors)


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def write_kv_slots(cache: torch.Tensor, k_nhd: torch.Tensor, v_nhd: torch.Tensor,
                   write_index: torch.Tensor) -> None:
    """Write into ``cache`` [pages, 2, page, H, D] at flat slots ``page_id * page + slot``: on
    CUDA with Triton one kernel (``write_kernel``), else torch indexing."""
    writer = _kernel("write_kv_rows") if cache.is_cuda else None
    if writer is not None and rows_dense(k_nhd) and rows_dense(v_nhd):
        writer(cache, k_nhd, v_nhd, write_index)
        return
    page = cache.shape[2]
    page_ids, slots = write_index // page, write_index % page
    cache[page_ids, 0, slots] = k_nhd.to(cache.dtype)
    cache[page_ids, 1, slots] = v_nhd.to(cache.dtype)


def rows_dense(x_nhd: torch.Tensor) -> bool:
    """Whether each token's [heads, dim] of ``x_nhd`` is one dense block (rows may be apart)."""
    return x_nhd.stride(2) == 1 and x_nhd.stride(1) == x_nhd.shape[2]


@functools.cache
def _kernel(name: str):
    """A Triton kernel's launcher, ``write_kv_rows`` or ``norm_rope_write``, where its module
    imports (Triton is a dependency on Linux), else None (indexing, or the model's own norms
    and RoPE, instead); imported on first GPU use."""
    module = {"write_kv_rows": "write_kernel", "norm_rope_write": "rotate_kernel"}[name]
    try:
        return getattr(importlib.import_module(f"torch_cp.kv.{module}"), name)
    except ImportError:
        return None


def write_layer(caches: list[torch.Tensor], new_a: torch.Tensor, new_b: torch.Tensor,
                write_index: torch.Tensor, layer_idx: int) -> None:
    """Layer ``layer_idx``'s write at flat physical slots: GQA ``caches = [kv]`` (every layer's
    pool tensor) with ``new_a, new_b = k, v``; MLA ``caches = [ckv, kpe]`` with the new latents
    and rope keys. (The whole pool and an index, not a view of the layer: see
    ``torch_cp.graphs.compile``.)

    Traced by torch.compile it is the custom op ``torch_cp::write_kv``, which declares the
    mutation, so the compiled step writes the pool in place (traced as plain indexing,
    functionalization rebuilt the layer's and the whole pool's tensors every layer: 132 ms per
    Qwen3-8B decode step at 1,280 pages). Eagerly it skips the op's dispatch (~0.1 ms a call on
    the development machine).
    """
    if torch.compiler.is_compiling():
        write_kv(caches, new_a, new_b, write_index, layer_idx)
    else:
        _store(caches, new_a, new_b, write_index, layer_idx)


def _store(caches: list[torch.Tensor], new_a: torch.Tensor, new_b: torch.Tensor,
           write_index: torch.Tensor, layer_idx: int) -> None:
    caches = [c[layer_idx] for c in caches]
    # Indexing would broadcast a wrong head count into the pool (a sharding bug) silently.
    slots = [caches[0].shape[3:]] * 2 if len(caches) == 1 else [c.shape[2:] for c in caches]
    assert [new_a.shape[1:], new_b.shape[1:]] == slots, f"new K/V do not fit the pool's {slots}"
    if len(caches) == 1:
        write_kv_slots(caches[0], new_a, new_b, write_index)
        return
    for cache, new in zip(caches, (new_a, new_b)):
        cache.view(-1, cache.shape[-1]).index_copy_(0, write_index, new.to(cache.dtype))


@torch.library.custom_op("torch_cp::write_kv", mutates_args=("caches",))
def write_kv(caches: list[torch.Tensor], new_a: torch.Tensor, new_b: torch.Tensor,
             write_index: torch.Tensor, layer_idx: int) -> None:
    """``write_layer`` as an op that mutates ``caches`` (what torch.compile sees)."""
    _store(caches, new_a, new_b, write_index, layer_idx)


# On: a GQA pool on CUDA takes its layers' new queries and keys through their norms and RoPE, and
# the keys and values into the pool, in one kernel (``rotate_and_write``; read at each trace).
# Off: the model's own norms and RoPE, then ``write``. On since runs 140-142 (one H100): its GPU
# tests passed, and a batch-1 step took 1.1 % (Qwen3-8B) and 3.3 % (Qwen3-30B-A3B) less.
ROTATE_IN_ONE_KERNEL = True
ROTATE_IN_INTERPRETER = False  # tests: that kernel in Triton's interpreter on a CPU pool


@torch.library.custom_op("torch_cp::rotate_and_write", mutates_args=("caches",))
def rotate_and_write(caches: list[torch.Tensor], q_nhd: torch.Tensor, k_nhd: torch.Tensor,
                    v_nhd: torch.Tensor, q_weight: torch.Tensor | None,
                    k_weight: torch.Tensor | None, eps: float, cos_nr: torch.Tensor,
                    sin_nr: torch.Tensor, write_index: torch.Tensor, layer_idx: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``GQAPool.rotate_and_write`` as an op that mutates ``caches`` (what torch.compile sees)."""
    return _kernel("norm_rope_write")(q_nhd, k_nhd, v_nhd, q_weight, k_weight, eps, cos_nr,
                                      sin_nr, caches[0][layer_idx], write_index)


@rotate_and_write.register_fake
def _(caches, q_nhd, k_nhd, v_nhd, q_weight, k_weight, eps, cos_nr, sin_nr, write_index,
      layer_idx):
    return torch.empty_like(q_nhd, memory_format=torch.contiguous_format), torch.empty(
        k_nhd.shape, dtype=q_nhd.dtype, device=q_nhd.device)


class MLAPool:
    """Latent KV of every layer: ``ckv[layer]`` [pages + 1, page_size // P, kv_lora_rank] and
    ``kpe[layer]`` [pages + 1, page_size // P, rope_dim]."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_lora_rank: int,
                 rope_dim: int, placement: ContextParallel, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.placement = placement
        self.page_size = page_size
        self.local_page_size = placement.local_page_size(page_size)
        self.num_pages = num_pages
        self.sink_page = num_pages
        shape = (num_layers, num_pages + 1, self.local_page_size)
        self.ckv = torch.zeros(*shape, kv_lora_rank, dtype=dtype, device=device)
        self.kpe = torch.zeros(*shape, rope_dim, dtype=dtype, device=device)

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every layer's pool tensors: ``[ckv, kpe]``."""
        return [self.ckv, self.kpe]

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ckv[layer_idx], self.kpe[layer_idx]

    def write(self, layer_idx: int, ckv_nd: torch.Tensor, kpe_nd: torch.Tensor,
              write_index: torch.Tensor) -> None:
        """Store new tokens' latent ``ckv_nd`` [N, kv_lora_rank] and rope key ``kpe_nd``
        [N, rope] at flat physical slots."""
        write_layer(self.tensors, ckv_nd, kpe_nd, write_index, layer_idx)

    @property
    def bytes(self) -> int:
        return _bytes(self.tensors)
