"""torch_cp's decode kernel for the gated delta rule (state/decode_kernel.py), which reads and
writes the state pool's slots in place, against transformers' torch recurrent rule on states
gathered out of the pool and scattered back (what the torch backend runs). On CUDA it runs
compiled (a ``gpu`` test); without CUDA, in Triton's interpreter (tests/conftest.py).

Rows: a resuming row, fresh rows (they read the zero slot, never their own, which holds NaN here),
and padding rows on the sink slot (NaN too): outputs and written states equal the reference's,
no other slot changes (bit for bit), the zero slot stays zero. Through ``delta_rule_step``
(``kernels="fla"`` decode steps take this kernel) the same, and as the model calls it: one layer
of a [layers, slots, ...] pool (the others untouched), q, k and v strided views into a packed
projection, Dk = 128. Value heads grouped over key heads (2 each), Dv not a multiple of the
kernel's block (48 of 32: a masked block).

Tolerance: float32 states and outputs within 1e-5 (the two sum over Dk in other orders: observed
2e-7); a bf16 output within one bf16 rounding of the reference's (rtol 2**-7; observed 2e-3
absolute on values of ~0.5).
"""

from __future__ import annotations

import pytest
import torch

from torch_cp import compat
from torch_cp.state.kernels import delta_rule_step

triton = pytest.importorskip("triton", reason="the kernel is Triton (CPU: its interpreter)")
from torch_cp.state.decode_kernel import decode_step_in_place  # noqa: E402

DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(
                torch.cuda.is_available(), reason="Triton's interpreter runs only without CUDA")),
           pytest.param("cuda", marks=pytest.mark.gpu)]
ROWS, HK, HV, DK, DV, SLOTS = 5, 2, 4, 16, 48, 8
SINK, ZERO = SLOTS, SLOTS + 1
SLOTS_B = [3, 0, 5, SINK, SINK]  # row 0 resumes, 1 and 2 are fresh, 3 and 4 are padding
FRESH_B = [False, True, True, True, True]


def case(dtype, device):
    g = torch.Generator().manual_seed(0)
    states = torch.randn(SLOTS + 2, HV, DK, DV, generator=g)
    states[1:3] = float("nan")  # fresh rows' own slots: never read
    states[SINK] = float("nan")
    states[ZERO] = 0
    inputs = [torch.randn(ROWS, HK, DK, generator=g), torch.randn(ROWS, HK, DK, generator=g),
              torch.randn(ROWS, HV, DV, generator=g), -torch.rand(ROWS, HV, generator=g),
              torch.rand(ROWS, HV, generator=g)]
    slots, fresh = torch.tensor(SLOTS_B), torch.tensor(FRESH_B)
    return [t.to(device, dtype) for t in inputs], states.to(device), slots.to(device), \
        fresh.to(device)


def reference(inputs, states, slots, fresh):
    """transformers' torch recurrent rule over states gathered from the pool, then scattered."""
    q, k, v, g, beta = inputs
    _, recurrent = compat.torch_gated_delta_rules()
    start = torch.where(fresh, torch.full_like(slots, ZERO), slots)
    out, h = recurrent(q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None],
                       initial_state=states.index_select(0, start), output_final_state=True,
                       use_qk_l2norm_in_kernel=True)
    after = states.clone()
    after.index_copy_(0, slots, h.float())
    return out[:, 0], after


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("through", ["kernel", "delta_rule_step"])
def test_decode_kernel_updates_the_pool_in_place_like_the_reference(dtype, through, device):
    inputs, states, slots, fresh = case(dtype, device)
    want_out, want_states = reference(inputs, states, slots, fresh)
    got_states = states.clone()
    if through == "kernel":
        got_out = decode_step_in_place(*inputs, got_states, slots, fresh)
    else:
        # As the model calls it: fresh rows as the plan's int64 flags (StepPlan.state_fresh).
        got_out = delta_rule_step(*inputs, got_states, slots, fresh.long(), qo_indptr=None,
                                  decode=True, kernels="fla")
    assert got_out.dtype == dtype and got_out.shape == (ROWS, HV, DV)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=2**-7)
    real = slice(0, 3)  # padding rows' outputs are NaN-free garbage nobody reads
    torch.testing.assert_close(got_out[real], want_out[real].to(dtype), **tol)
    for slot in SLOTS_B[:3]:
        torch.testing.assert_close(got_states[slot], want_states[slot], atol=1e-5, rtol=1e-5)
    untouched = [s for s in range(SLOTS + 2) if s not in SLOTS_B]
    assert torch.equal(got_states[untouched].nan_to_num(7.0), states[untouched].nan_to_num(7.0))
    assert torch.equal(got_states[ZERO], torch.zeros_like(got_states[ZERO]))


@pytest.mark.parametrize("device", DEVICES)
def test_decode_kernel_on_one_layer_of_the_pool_from_strided_views(device):
    """As the model calls it: one layer of a [layers, slots, ...] pool, q, k and v views into a
    packed projection (row stride the projection's width), the real head size of 128."""
    dk, layers, layer = 128, 3, 1
    g = torch.Generator().manual_seed(1)
    pool = torch.randn(layers, SLOTS + 2, HV, dk, DV, generator=g)
    pool[:, ZERO] = 0
    pool[:, SINK] = float("nan")
    packed = torch.randn(ROWS, 2 * HK * dk + HV * DV, generator=g).to(device)
    q, k = (packed[:, i * HK * dk:(i + 1) * HK * dk].view(ROWS, HK, dk) for i in range(2))
    v = packed[:, 2 * HK * dk:].view(ROWS, HV, DV)
    assert not (q.is_contiguous() or v.is_contiguous())
    gates = [-torch.rand(ROWS, HV, generator=g).to(device),
             torch.rand(ROWS, HV, generator=g).to(device)]
    pool = pool.to(device)
    slots, fresh = torch.tensor(SLOTS_B, device=device), torch.tensor(FRESH_B, device=device)
    want_out, want_states = reference([q, k, v, *gates], pool[layer], slots, fresh)
    got = pool.clone()
    out = delta_rule_step(q, k, v, *gates, got[layer], slots, fresh, qo_indptr=None, decode=True,
                          kernels="fla")
    torch.testing.assert_close(out[:3], want_out[:3], atol=1e-5, rtol=1e-5)
    for slot in SLOTS_B[:3]:
        torch.testing.assert_close(got[layer, slot], want_states[slot], atol=1e-5, rtol=1e-5)
    others = [i for i in range(layers) if i != layer]
    assert torch.equal(got[others].nan_to_num(7.0), pool[others].nan_to_num(7.0))


def test_a_key_head_the_kernel_cannot_hold_takes_the_recurrent_rule(monkeypatch):
    """Dk = 48 (not a power of two, which the kernel's key block needs): ``kernels="fla"``
    decode runs the library's recurrent rule on gathered states instead of failing (here the
    torch rule stands in for fla's, which needs CUDA)."""
    import torch_cp.state.kernels as kernels_module

    monkeypatch.setattr(kernels_module, "_functions",
                        lambda kernels: compat.torch_gated_delta_rules())
    g = torch.Generator().manual_seed(1)
    states = torch.randn(SLOTS + 2, HV, 48, DV, generator=g)
    states[ZERO] = 0
    inputs = [torch.randn(ROWS, HK, 48, generator=g), torch.randn(ROWS, HK, 48, generator=g),
              torch.randn(ROWS, HV, DV, generator=g), -torch.rand(ROWS, HV, generator=g),
              torch.rand(ROWS, HV, generator=g)]
    slots, fresh = torch.tensor([3, 0, 5, 6, 7]), torch.tensor(FRESH_B)
    want_out, want_states = reference(inputs, states, slots, fresh)
    got = delta_rule_step(*inputs, states, slots, fresh, None, True, "fla")
    torch.testing.assert_close(got, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, want_states, atol=1e-5, rtol=1e-5)
