"""Every core configuration check raises ValueError naming each problem it finds.

No process group is initialised here: init_mesh must refuse before it would start one (the test
fails if it tries), and partner_placement is refused from the mesh's sizes alone (a stand-in mesh
with only ``size``).
"""

import pytest
import torch
import torch.distributed as dist

from torch_cp.kv import GQAPool, MLAPool, PageAllocator
from torch_cp.mesh import (
    context_parallel_problems,
    init_mesh,
    kv_head_replicas,
    partner_placement,
)
from torch_cp.placement import ContextParallel
from torch_cp.plan import build_step_plan

GROUP = object()  # a stand-in process group: these checks never use it


@pytest.mark.parametrize("heads,tp", [(3, 2), (4, 6), (6, 4), (5, 3), (2, 3)])
def test_kv_heads_that_do_not_split_evenly_are_refused(heads, tp):
    with pytest.raises(ValueError, match=rf"{heads} KV heads do not split evenly over tp = {tp}"):
        kv_head_replicas(heads, tp)


@pytest.mark.parametrize("heads,tp,replicas,held", [
    (4, 2, 1, [[0, 1], [2, 3]]), (2, 4, 2, [[0], [0], [1], [1]]), (1, 4, 4, [[0]] * 4),
    (8, 8, 1, [[h] for h in range(8)]),
])
def test_kv_heads_that_split_evenly_are_laid_out(heads, tp, replicas, held):
    layout = kv_head_replicas(heads, tp)
    assert layout.replicas == replicas
    assert [list(layout.heads_of(r)) for r in range(tp)] == held
    assert [layout.partner_index(r) for r in range(tp)] == [r % replicas for r in range(tp)]


@pytest.mark.parametrize("heads,tp", [(0, 2), (2, 0), (-1, -1)])
def test_non_positive_heads_or_tp_are_refused(heads, tp):
    with pytest.raises(ValueError, match=rf"num_kv_heads >= 1 and tp >= 1, got {heads} and {tp}"):
        kv_head_replicas(heads, tp)


@pytest.mark.parametrize("size,page_size", [(2, 5), (4, 2), (4, 6), (8, 12)])
def test_page_size_must_be_a_multiple_of_p(size, page_size):
    cp = ContextParallel(size, 0, group=GROUP)
    message = rf"page_size {page_size} is not a multiple of P = {size}"
    with pytest.raises(ValueError, match=message):
        GQAPool(1, 4, page_size, 1, 8, cp, torch.float32)
    with pytest.raises(ValueError, match=message):
        MLAPool(1, 4, page_size, 8, 4, cp, torch.float32)
    with pytest.raises(ValueError, match=message):
        build_step_plan([1], [0], [[0]], page_size=page_size, sink_page=4, placement=cp)


@pytest.mark.parametrize("kwargs,named", [
    (dict(size=2, rank=2, group=GROUP), ["rank 2 is outside [0, 2)"]),
    (dict(size=4, rank=-1, group=GROUP), ["rank -1 is outside [0, 4)"]),
    (dict(size=1, rank=0, mode="dp"), ["mode must be 'tp' or 'sp', got 'dp'"]),
    (dict(size=2, rank=0), ["needs a process group"]),
    (dict(size=0, rank=0), ["size must be >= 1, got 0"]),
    (dict(size=2, rank=3, mode="pp"),
     ["rank 3 is outside [0, 2)", "mode must be 'tp' or 'sp', got 'pp'", "needs a process group"]),
])
def test_invalid_context_parallel_names_every_problem(kwargs, named):
    with pytest.raises(ValueError, match="invalid ContextParallel") as error:
        ContextParallel(**kwargs)
    for problem in named:
        assert problem in str(error.value)


@pytest.mark.parametrize("mode,heads,tp,sp,named", [
    ("tp", 4, 4, 1, "TP-mode context parallelism needs tp > kv_heads"),
    ("tp", 8, 2, 2, "got tp = 2, kv_heads = 8"),
    ("sp", 8, 2, 1, "SP-mode context parallelism needs sp >= 2, got sp = 1"),
    ("dp", 2, 4, 2, "context-parallel mode must be 'tp' or 'sp', got 'dp'"),
])
def test_context_parallel_problems(mode, heads, tp, sp, named):
    problems = context_parallel_problems(mode, heads, tp, sp)
    assert len(problems) == 1 and named in problems[0]


@pytest.mark.parametrize("mode,heads,tp,sp", [("tp", 2, 4, 1), ("tp", 1, 2, 3), ("sp", 8, 2, 2)])
def test_context_parallel_possible(mode, heads, tp, sp):
    assert context_parallel_problems(mode, heads, tp, sp) == []


class SizesOnly:
    """A mesh that answers only its axis sizes ("sp", "tp"): enough for a refusal."""

    def __init__(self, sp: int, tp: int):
        self.sizes = (sp, tp)

    def size(self, dim: int) -> int:
        return self.sizes[dim]


@pytest.mark.parametrize("mode,heads,sp,tp,named", [
    ("tp", 4, 1, 3, ["needs tp > kv_heads", "4 KV heads do not split evenly over tp = 3"]),
    ("tp", 4, 1, 6, ["4 KV heads do not split evenly over tp = 6"]),
    ("tp", 4, 2, 4, ["needs tp > kv_heads"]),
    ("sp", 4, 1, 8, ["SP-mode context parallelism needs sp >= 2"]),
])
def test_partner_placement_names_every_problem(mode, heads, sp, tp, named):
    with pytest.raises(ValueError) as error:
        partner_placement(SizesOnly(sp, tp), mode, heads)
    for problem in named:
        assert problem in str(error.value)


def test_partner_placement_without_mesh_is_one_partner():
    assert partner_placement(None, "tp", 4) == ContextParallel.single()


@pytest.mark.parametrize("world,tp,sp,named", [
    ("4", 2, 1, ["sp * tp = 1 * 2 = 2 does not match the world size 4"]),
    ("1", 2, 2, ["sp * tp = 2 * 2 = 4 does not match the world size 1"]),
    ("8", 0, -1, ["tp must be an int >= 1, got 0", "sp must be an int >= 1, got -1"]),
])
def test_init_mesh_refuses_a_mesh_that_is_not_the_world(monkeypatch, world, tp, sp, named):
    def start_group(*args, **kwargs):
        raise AssertionError("init_mesh started a process group before refusing")

    # torchrun's whole environment (init_mesh refuses a partial one before the world size)
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", "29500")
    # as in a fresh torchrun process, whatever group another test module left in this one
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", start_group)
    with pytest.raises(ValueError, match="invalid mesh") as error:
        init_mesh(tp=tp, sp=sp, device_type="cpu")
    for problem in named:
        assert problem in str(error.value)


def test_step_plan_names_every_problem():
    cp = ContextParallel(2, 0, group=GROUP)
    with pytest.raises(ValueError) as error:
        build_step_plan([0, 3, 2], [0, 5], [[0], [1], [2]], page_size=3, sink_page=9,
                        placement=cp)
    for problem in ("page_size 3 is not a multiple of P = 2", "one entry per row",
                    "at least one new token, got q_lens=[0, 3, 2]",
                    "row 1: 1 pages cannot hold 8 tokens"):
        assert problem in str(error.value)


def test_allocator_geometry_is_refused():
    with pytest.raises(ValueError, match="got 0, -2"):
        PageAllocator(0, -2)
