"""The state pool: each running request's conv and recurrent state, one slot per request.

Linear-attention layers (gated DeltaNet) carry a fixed-size state instead of a growing KV cache:
the last ``K - 1`` inputs of a short causal conv, and a recurrent ``[v_heads, k_dim, v_dim]``
matrix per head. It is never striped: in TP mode a rank holds its share of the heads (split like
any head), in SP mode every partner holds the same state and computes it the same way. Slot
``num_slots`` is the sink slot that padding rows of a captured bucket write, and the last slot,
``num_slots + 1``, holds zeros and is never written: a row with no context (a new request, a
padding row) starts from it, so a reused slot needs no clearing and its old contents (NaN
included) are never read.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from torch_cp.state.ops import register_pool


@dataclass(frozen=True)
class LinearGeometry:
    """Per-rank shapes of a hybrid model's linear-attention layers.

    Attributes:
        layers: linear-attention layers (state pool index = their order in the model).
        k_heads, v_heads: key/query and value heads this rank holds (``v_heads % k_heads == 0``).
        k_dim, v_dim: their sizes.
        conv_kernel: the causal conv's kernel width K (the conv state keeps K - 1 inputs).
    """

    layers: int
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int

    @classmethod
    def from_config(cls, config, tp: int = 1) -> LinearGeometry:
        """The shapes of a hybrid text ``config``'s linear layers on one of ``tp`` ranks;
        ValueError when its heads do not split over ``tp`` (``linear_head_problems``)."""
        problems = linear_head_problems(config, tp)
        if problems:
            raise ValueError("; ".join(problems))
        return cls(layers=sum(t == "linear_attention" for t in config.layer_types),
                   k_heads=config.linear_num_key_heads // tp,
                   v_heads=config.linear_num_value_heads // tp,
                   k_dim=config.linear_key_head_dim, v_dim=config.linear_value_head_dim,
                   conv_kernel=config.linear_conv_kernel_dim)

    @property
    def conv_channels(self) -> int:
        """Conv channels: q, k (``k_heads * k_dim`` each) and v (``v_heads * v_dim``)."""
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    def slot_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one request's state takes on this rank, every layer (recurrent state fp32)."""
        conv = self.conv_channels * (self.conv_kernel - 1) * torch.finfo(dtype).bits // 8
        recurrent = self.v_heads * self.k_dim * self.v_dim * 4
        return self.layers * (conv + recurrent)


def linear_head_problems(config, tp: int) -> list[str]:
    """Linear-attention heads must split evenly over ``tp``, and each key head serve a whole
    number of value heads."""
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    problems = [f"{n} linear-attention {what} heads (linear_num_{what}_heads) do not split "
                f"evenly over tp = {tp}" for what, n in (("key", hk), ("value", hv)) if n % tp]
    if hv % hk:
        problems.append(f"linear_num_value_heads {hv} is not a multiple of linear_num_key_heads "
                        f"{hk}")
    return problems


RESERVED_SLOTS = 2  # the sink slot and the zero slot, after the request slots


class StatePool:
    """Every linear layer's state: ``conv`` [layers, slots + 2, channels, K - 1] in the model's
    dtype (the inputs the conv saw last, as transformers keeps them) and ``recurrent``
    [layers, slots + 2, v_heads, k_dim, v_dim] in float32 (what the gated delta rule kernels
    accumulate in). Slot ``sink_slot = num_slots`` belongs to padding rows; slot
    ``zero_slot = num_slots + 1`` stays zero (the start of every row without context).

    Args:
        geometry: this rank's linear-attention shapes.
        num_slots: requests that can run at once.
    """

    def __init__(self, geometry: LinearGeometry, num_slots: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        if num_slots < 1:
            raise ValueError(f"a state pool needs num_slots >= 1, got {num_slots}")
        g = geometry
        self.geometry = g
        self.num_slots = num_slots
        self.sink_slot = num_slots
        self.zero_slot = num_slots + 1
        slots = num_slots + RESERVED_SLOTS
        self.conv = torch.zeros(g.layers, slots, g.conv_channels, g.conv_kernel - 1,
                                dtype=dtype, device=device)
        self.recurrent = torch.zeros(g.layers, slots, g.v_heads, g.k_dim, g.v_dim,
                                     dtype=torch.float32, device=device)
        self.step = None  # the step plan of the forward about to run (begin_step)
        self.handle = register_pool(self)

    def __deepcopy__(self, memo):
        """A copy with its own tensors, known to the ops by its own handle (a copied handle
        would run the copy's layers on the original's step)."""
        new = copy.copy(self)
        memo[id(self)] = new
        with torch.inference_mode(False):  # a copy made under inference_mode serves outside it
            new.conv, new.recurrent = self.conv.clone(), self.recurrent.clone()
        new.step = None
        new.handle = register_pool(new)
        return new

    def begin_step(self, plan) -> None:
        """Make ``plan`` (a ``StepPlan`` with ``state_slots``) the step the state ops run: they
        read its slots, context lengths and row bounds (a captured step: its static buffers)."""
        self.step = plan

    def copy_slot(self, source: int, target: int) -> None:
        """Slot ``target`` takes slot ``source``'s state, every layer (a prefix-cache state
        checkpoint taken or restored; ordered on the device after the steps launched before)."""
        with torch.inference_mode():
            for states in self.tensors:
                states[:, target] = states[:, source]

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.conv, self.recurrent]

    @property
    def bytes(self) -> int:
        """Bytes of this rank's state pool (the sink and zero slots included)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @staticmethod
    def bytes_for(geometry: LinearGeometry, num_slots: int, dtype: torch.dtype) -> int:
        """``bytes`` of a pool of ``num_slots`` request slots, without allocating it."""
        return (num_slots + RESERVED_SLOTS) * geometry.slot_bytes(dtype)
