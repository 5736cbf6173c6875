"""The state kernels (torch_cp/state/kernels.py) against whole sequences run at once (invariant 9
at the kernel level), and padding safety for state (invariant 4).

A step packs some tokens of some rows; each row's conv and recurrent state sit in a pool slot
between steps. Whatever way a row's sequence is cut into steps (one prefill, chunks, decode
steps, rows in any order and any slot, other rows alongside), its outputs must equal the whole
sequence run once from a zero state by transformers' torch functions (``causal_conv1d_fn``, the
token-by-token ``torch_recurrent_gated_delta_rule``), and its state the whole sequence's final one.

Tolerance: fp32, outputs and states of magnitude ~0.1-3. The kernels and the reference differ only
in summation order (the conv over a window split between state and new inputs; the chunked delta
rule's triangular solve against the token-by-token recurrence): observed <= 1.1e-6. TOL (1e-5)
leaves 10x margin and stays far below what a wrong start state or a lost token changes (~0.1).
The conv state is pure data movement and is compared bit for bit.

Pools are ``StatePool``'s (request slots, the sink slot, and any slot it keeps beside them, such
as the zero slot fresh rows read), with random garbage or NaN in the request and sink slots.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_5 import modeling_qwen3_5

from torch_cp import compat
from torch_cp.state import LinearGeometry, StatePool
from torch_cp.state.kernels import conv_step, delta_rule_step
from torch_cp.state.ops import register_pool, state_conv, state_delta_rule

HK, HV, DK, DV, K = 2, 4, 8, 4, 4  # Hv = 2 Hk: value heads share key heads, as in the models
C = 2 * HK * DK + HV * DV
SLOTS = 6  # slot SLOTS is the sink slot
TOL = dict(atol=1e-5, rtol=1e-5)
KEYS = ("x", "q", "k", "v", "g", "beta")


def make_rows(lengths, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Each row's whole input sequence: conv input x, q, k, v, g (log decay <= 0) and beta."""
    gen = torch.Generator().manual_seed(seed)
    randn = functools.partial(torch.randn, generator=gen)
    return [dict(x=randn(n, C), q=randn(n, HK, DK), k=randn(n, HK, DK), v=randn(n, HV, DV),
                 g=-2 * torch.rand(n, HV, generator=gen), beta=torch.rand(n, HV, generator=gen))
            for n in lengths]


def conv_weight(seed: int = 1) -> torch.Tensor:
    return 0.5 * torch.randn(C, K, generator=torch.Generator().manual_seed(seed))


def last_inputs(x_nc: torch.Tensor) -> torch.Tensor:
    """The conv state after inputs ``x_nc``: the last K - 1 of them, zeros before the first."""
    return F.pad(x_nc.T, (K - 1, 0))[:, x_nc.shape[0]:]


def reference(row, weight):
    """(conv output [L, C], conv state, delta rule output [L, Hv, Dv], recurrent state) of a
    row's whole sequence from zero state, by transformers' torch functions."""
    conv_fn = compat.unwrapped(modeling_qwen3_5.causal_conv1d_fn, "causal_conv1d_fn")
    conv = conv_fn(row["x"].T[None], weight, activation="silu")[0].T
    _, recurrent = compat.torch_gated_delta_rules()
    out, state = recurrent(row["q"][None], row["k"][None], row["v"][None], g=row["g"][None],
                           beta=row["beta"][None], output_final_state=True,
                           use_qk_l2norm_in_kernel=True)
    return conv, last_inputs(row["x"]), out[0], state[0]


def new_pools(fill: float | None = None, seed: int = 2, layers: int = 1):
    """A StatePool's conv and recurrent tensors ([layers, slots, ...]; layer 0 alone when
    ``layers`` is 1) with every request slot and the sink slot holding random garbage, as
    finished requests leave them, or ``fill``; any other slot of the pool as the pool keeps it."""
    geometry = LinearGeometry(layers=layers, k_heads=HK, v_heads=HV, k_dim=DK, v_dim=DV,
                              conv_kernel=K)
    pool = StatePool(geometry, SLOTS, torch.float32)
    assert pool.sink_slot == SLOTS
    gen = torch.Generator().manual_seed(seed)
    for t in pool.tensors:
        used = t[:, :SLOTS + 1]
        used.copy_(torch.randn(used.shape, generator=gen) if fill is None else fill)
    return (pool.conv, pool.recurrent) if layers > 1 else (pool.conv[0], pool.recurrent[0])


def packed(rows, step, pos) -> dict[str, torch.Tensor]:
    return {key: torch.cat([rows[r][key][pos[r]:pos[r] + n] for r, n in step]) for key in KEYS}


def step_args(lengths, slots, fresh):
    """(slots_b, fresh_b, qo_indptr, decode) of a step's rows of ``lengths`` new tokens."""
    qo = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    qo[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return torch.tensor(slots), torch.tensor(fresh), qo, all(n == 1 for n in lengths)


def args_of(step, pos, slots):
    """``step_args`` of a step of (row, tokens) pairs, rows at ``pos`` and in ``slots``."""
    return step_args([n for _, n in step], [slots[r] for r, _ in step],
                     [pos[r] == 0 for r, _ in step])


def run_kernels(x, weight, conv, recurrent, slots_b, fresh_b, qo, decode):
    """Both kernels on a step's packed inputs ``x``: (conv output, delta rule output)."""
    conv_out = conv_step(x["x"], weight, conv, slots_b, fresh_b, qo, decode, "silu")
    out = delta_rule_step(x["q"], x["k"], x["v"], x["g"], x["beta"], recurrent, slots_b, fresh_b,
                          qo, decode, "torch")
    return conv_out, out


def run_schedule(rows, schedule, slots, weight, pools, whole: bool = True):
    """Run ``schedule`` (steps of (row, tokens)) over ``pools`` with row r in ``slots[r]``,
    checking after every step that each stepped row's conv state is its last K - 1 inputs,
    bit for bit, and that no other slot changed. Returns each row's outputs, concatenated.
    ``whole``: the schedule runs every row to its end."""
    conv, recurrent = pools
    pos = [0] * len(rows)
    outs: list[list[tuple]] = [[] for _ in rows]
    for i, step in enumerate(schedule):
        args = args_of(step, pos, slots)
        before = conv.clone(), recurrent.clone()
        conv_out, out = run_kernels(packed(rows, step, pos), weight, conv, recurrent, *args)
        qo = args[2].tolist()
        for b, (r, n) in enumerate(step):
            outs[r].append((conv_out[qo[b]:qo[b + 1]], out[qo[b]:qo[b + 1]]))
            pos[r] += n
            assert torch.equal(conv[slots[r]], last_inputs(rows[r]["x"][:pos[r]])), (i, r)
        others = sorted(set(range(conv.shape[0])) - {slots[r] for r, _ in step})
        for pool, old in zip((conv, recurrent), before):  # NaN garbage must stay NaN too
            torch.testing.assert_close(pool[others], old[others], rtol=0, atol=0, equal_nan=True,
                                       msg=f"step {i} wrote another slot")
    assert not whole or pos == [row["x"].shape[0] for row in rows], "a token left out"
    return [(torch.cat([c for c, _ in o]), torch.cat([d for _, d in o])) for o in outs]


def check_against_reference(rows, schedule, slots, pools=None):
    weight = conv_weight()
    pools = new_pools() if pools is None else pools
    results = run_schedule(rows, schedule, slots, weight, pools)
    for r, (row, (conv_out, out)) in enumerate(zip(rows, results)):
        ref_conv, ref_conv_state, ref_out, ref_state = reference(row, weight)
        assert torch.equal(pools[0][slots[r]], ref_conv_state)
        torch.testing.assert_close((conv_out, out, pools[1][slots[r]]),
                                   (ref_conv, ref_out, ref_state), **TOL,
                                   msg=lambda m, r=r: f"row {r} (conv, delta rule, state): {m}")


def decode_rest(prefill, lengths):
    """``prefill`` (steps of (row, tokens)), then decode steps: every unfinished row one token."""
    left = [n - sum(m for s in prefill for q, m in s if q == r) for r, n in enumerate(lengths)]
    return prefill + [[(r, 1) for r in range(len(lengths)) if left[r] > i]
                      for i in range(max(left))]


LENGTHS = [5, 1, 9, 70]  # 70: two of the chunked rule's 64-token chunks
SCHEDULES = {
    "one-step": [[(0, 5), (1, 1), (2, 9), (3, 70)]],
    # chunks of every size, rows in any order, a row finishing beside rows that go on
    "chunks": [[(3, 30), (2, 4)], [(2, 5), (0, 2), (3, 20)], [(1, 1), (0, 3), (3, 20)]],
    "decode-after-prefill": decode_rest([[(0, 2), (1, 1), (2, 3), (3, 64)]], LENGTHS),
    # a decode row (one token after its context) in a multi-token step beside an extend row
    "decode-beside-extend": decode_rest([[(0, 2), (1, 1), (2, 3), (3, 60)], [(0, 1), (3, 7)]],
                                        LENGTHS),
    # the 1-token prompt arrives in a decode step: a fresh row on the decode path
    "one-token-prompt-in-decode": decode_rest([[(0, 2), (2, 3), (3, 64)],
                                               [(1, 1), (0, 1), (2, 1), (3, 1)]], LENGTHS),
}


@pytest.mark.parametrize("name", SCHEDULES)
def test_steps_equal_the_whole_sequence(name):
    check_against_reference(make_rows(LENGTHS), SCHEDULES[name], slots=[5, 0, 3, 2])


def test_a_fresh_row_starts_from_zeros_whatever_its_slot_holds():
    """Every request slot and the sink slot hold NaN, as a finished request may leave them:
    fresh rows (prefill steps, and a 1-token prompt on the decode path) start from zeros, and
    nothing turns NaN."""
    pools, slots = new_pools(fill=float("nan")), [1, 4, 0, 5]
    check_against_reference(make_rows(LENGTHS), SCHEDULES["one-token-prompt-in-decode"], slots,
                            pools=pools)
    assert all(p[slots].isfinite().all() for p in pools)


@st.composite
def schedules(draw):
    """Row lengths, a random cut of each row into steps (several rows a step, any order), and
    distinct slots."""
    lengths = draw(st.lists(st.integers(1, 80), min_size=1, max_size=4))
    left = list(lengths)
    steps = []
    while any(left):
        live = [r for r in range(len(left)) if left[r]]
        chosen = draw(st.lists(st.sampled_from(live), min_size=1, unique=True))
        step = [(r, draw(st.one_of(st.just(1), st.integers(1, left[r])))) for r in chosen]
        for r, n in step:
            left[r] -= n
        steps.append(step)
    slots = draw(st.permutations(range(SLOTS)))[:len(lengths)]
    return lengths, steps, slots


@settings(max_examples=30, deadline=None)
@given(case=schedules(), seed=st.integers(0, 2**16))
def test_any_cut_into_steps_equals_the_whole_sequence(case, seed):
    lengths, steps, slots = case
    check_against_reference(make_rows(lengths, seed), steps, slots)


def prefilled(lengths, slots, left: int):
    """Rows and pools after one prefill step of every row but its last ``left`` tokens."""
    rows = make_rows(lengths)
    pools = new_pools()
    run_schedule(rows, [[(r, n - left) for r, n in enumerate(lengths)]], slots, conv_weight(),
                 pools, whole=False)
    return rows, pools


def without_sink(pool: torch.Tensor) -> torch.Tensor:
    return torch.cat([pool[:SLOTS], pool[SLOTS + 1:]])


def finite_then_nan(pools, x, pad: int, run) -> list[list[torch.Tensor]]:
    """``run(padded inputs, conv, recurrent, fill)`` on copies of ``pools`` with ``pad`` padding
    tokens of ``fill`` after the inputs ``x``, fill 1.5 then NaN."""
    results = []
    for fill in (1.5, math.nan):
        conv, recurrent = (p.clone() for p in pools)
        padded = {k: torch.cat([v, torch.full((pad, *v.shape[1:]), fill)]) for k, v in x.items()}
        results.append(run(padded, conv, recurrent, fill))
    return results


@pytest.mark.parametrize("padding_fresh", [True, False], ids=["padding-fresh", "padding-not"])
def test_nan_padding_rows_leave_real_rows_bit_identical(padding_fresh):
    """A decode step padded with rows at the sink slot (the plan marks them fresh, so they start
    from zeros; not fresh, reading the sink slot, is covered too): NaN in their inputs and in
    the sink slot leaves the real rows' outputs and states bit-identical to the same step with
    finite padding, close to the unpadded step, and reaches no slot but the sink."""
    lengths, slots, pad, weight = [4, 7, 3], [3, 0, 5], 2, conv_weight()
    rows, pools = prefilled(lengths, slots, left=1)
    x = packed(rows, [(r, 1) for r in range(3)], [n - 1 for n in lengths])

    def run(padded, conv, recurrent, fill):
        conv[SLOTS], recurrent[SLOTS] = fill, fill  # the sink slot
        args = step_args([1] * 5, slots + [SLOTS] * pad, [False] * 3 + [padding_fresh] * pad)
        outs = run_kernels(padded, weight, conv, recurrent, *args)
        return [o[:3] for o in outs] + [without_sink(conv), without_sink(recurrent)]

    finite, nan = finite_then_nan(pools, x, pad, run)
    assert all(torch.equal(a, b) and b.isfinite().all() for a, b in zip(finite, nan))
    conv, recurrent = (p.clone() for p in pools)
    unpadded = run_kernels(x, weight, conv, recurrent, *step_args([1] * 3, slots, [False] * 3))
    torch.testing.assert_close(nan, [*unpadded, without_sink(conv), without_sink(recurrent)],
                               **TOL)


def test_nan_tokens_past_the_rows_stay_out():
    """A multi-token step whose packed tokens run past its rows (token padding): NaN there leaves
    the real rows and every slot bit-identical, and the tokens past the rows come out zero."""
    lengths, slots = [4, 7, 3], [3, 0, 5]
    rows, pools = prefilled(lengths, slots, left=2)
    x = packed(rows, [(r, 2) for r in range(3)], [n - 2 for n in lengths])
    args = step_args([2] * 3, slots, [False] * 3)

    def run(padded, conv, recurrent, fill):
        outs = run_kernels(padded, conv_weight(), conv, recurrent, *args)
        assert all(torch.equal(o[6:], torch.zeros_like(o[6:])) for o in outs)
        return [o[:6] for o in outs] + [conv, recurrent]

    finite, nan = finite_then_nan(pools, x, 3, run)
    assert all(torch.equal(a, b) for a, b in zip(finite, nan))


def op_inputs(lengths, slots, fresh, seed=3):
    """Packed inputs of a step (every row's whole ``make_rows`` sequence), a 2-layer pool of
    garbage and the step's arguments."""
    x = {key: torch.cat([row[key] for row in make_rows(lengths, seed)]) for key in KEYS}
    return (x, *new_pools(layers=2), *step_args(lengths, slots, fresh))


OP_CASES = {"decode": ([1, 1, 1], [4, 1, SLOTS], [False, True, True]),
            "multi-token": ([4, 1, 2], [4, 1, 0], [True, False, False])}


class Planned:
    """What the ops find by their handle (a ``StatePool`` planned for a step): the step's slots,
    context lengths (0: fresh), row bounds and kind."""

    def __init__(self, slots_b, fresh_b, qo, decode):
        token_row = torch.repeat_interleave(torch.arange(qo.shape[0] - 1), qo.diff())
        self.step = SimpleNamespace(state_slots=slots_b, state_fresh=fresh_b.long(),
                                    qo_indptr=qo, qo_indptr_host=qo, is_decode=decode,
                                    token_row=token_row)
        self.handle = register_pool(self)


def layer_step(x, weight, conv, recurrent, handle):
    """Layer 1's state ops as ``models/deltanet.py`` chains them: the conv's output split into
    q, k, v for the delta rule."""
    n = x["x"].shape[0]
    mixed = state_conv(x["x"], weight, conv, 1, handle, "silu", "torch")
    q, k, v = torch.split(mixed, [HK * DK, HK * DK, HV * DV], dim=-1)
    out = state_delta_rule(q.reshape(n, HK, DK), k.reshape(n, HK, DK), v.reshape(n, HV, DV),
                           x["g"], x["beta"], recurrent, 1, handle, "torch")
    return mixed, out.reshape(n, -1)


@pytest.mark.parametrize("case", OP_CASES)
def test_custom_ops_pass_opcheck(case):
    """torch.library.opcheck: the declared schema (which pool each op mutates), the fake
    kernels' outputs against the real ones, AOT dispatch. About 0.3 s per op and case."""
    x, conv, recurrent, *args = op_inputs(*OP_CASES[case])
    planned = Planned(*args)
    torch.library.opcheck(state_conv, (x["x"], conv_weight(), conv, 1, planned.handle, "silu",
                                       "torch"))
    torch.library.opcheck(state_delta_rule, (x["q"], x["k"], x["v"], x["g"], x["beta"],
                                             recurrent, 1, planned.handle, "torch"))


@pytest.mark.parametrize("backend", [
    "aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_custom_ops_compile_fullgraph(backend):
    """``layer_step`` under torch.compile(fullgraph=True) on layer 1 of a 2-layer pool: a
    multi-token step, then a decode step; outputs and pools equal eager's bit for bit (the
    kernels are the same opaque calls). aot_eager (Dynamo, AOT autograd's functionalisation of
    the pool mutation, the fake kernels): about 1 s on CPU; Inductor's C++ code generation on
    top: 1-3 s, but up to 20 s with a cold cache on a busy 2-core machine, so marked slow."""
    torch._dynamo.reset()
    compiled = torch.compile(layer_step, fullgraph=True, backend=backend)
    for case in ("multi-token", "decode"):
        x, conv, recurrent, *args = op_inputs(*OP_CASES[case])
        planned = Planned(*args)
        pools = {fn: (conv.clone(), recurrent.clone()) for fn in (layer_step, compiled)}
        eager_out, compiled_out = (fn(x, conv_weight(), *pools[fn], planned.handle)
                                   for fn in (layer_step, compiled))
        torch.testing.assert_close([*compiled_out, *pools[compiled]],
                                   [*eager_out, *pools[layer_step]], rtol=0, atol=0,
                                   equal_nan=True)
