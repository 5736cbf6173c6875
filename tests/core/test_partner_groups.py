"""Partner groups (mesh.py) against a brute-force assignment, for every mesh of up to 16 ranks.

Up to 4 ranks a transposed view of the mesh gives the same groups as the right one; from tp = 8
over 2 KV heads on it builds groups of the wrong size, so every (sp, tp, kv_heads) with
sp * tp <= 16 is checked. ``partner_placement`` is checked on stand-in meshes (no process is
spawned): each rank's placement is its group of the brute force, and the process group it builds
is made of exactly those ranks.

The expected groups are written plainly: global rank ``g = sp_index * tp + tp_index`` (DeviceMesh
row-major over ("sp", "tp")); TP mode: the TP ranks of the same SP index holding the same KV head,
``replicas = tp // kv_heads`` consecutive TP ranks, partner index ``tp_index % replicas``; SP
mode: the SP ranks of the same TP index, partner index ``sp_index``.
"""

from __future__ import annotations

import pytest
import torch

import torch_cp.mesh as mesh_module
from torch_cp.mesh import partner_groups, partner_placement


def head_splits_evenly(kv_heads: int, tp: int) -> bool:
    return kv_heads % tp == 0 or tp % kv_heads == 0


CONFIGS = [(sp, tp, kv) for sp in range(1, 17) for tp in range(1, 17) if sp * tp <= 16
           for kv in range(1, 17) if head_splits_evenly(kv, tp)]
TP_CASES = [(sp, tp, kv, "tp") for sp, tp, kv in CONFIGS if tp > kv]
SP_CASES = [(sp, tp, kv, "sp") for sp, tp, kv in CONFIGS if sp >= 2]
CASES = TP_CASES + SP_CASES


def brute_force(sp: int, tp: int, kv_heads: int, mode: str) -> dict[int, tuple[int, int, int]]:
    """For every global rank: (which group, partner index, P), the group named by what its
    members share."""
    out = {}
    for s in range(sp):
        for t in range(tp):
            g = s * tp + t
            if mode == "tp":
                replicas = tp // kv_heads
                head = t // replicas
                out[g] = (("sp", s, "head", head), t % replicas, replicas)
            else:
                out[g] = (("tp", t), s, sp)
    return out


def expected_groups(sp, tp, kv_heads, mode) -> list[list[int]]:
    """The brute force as lists of global ranks ordered by partner index."""
    members: dict[object, dict[int, int]] = {}
    for g, (key, index, _) in brute_force(sp, tp, kv_heads, mode).items():
        members.setdefault(key, {})[index] = g
    return [[by_index[i] for i in sorted(by_index)] for by_index in members.values()]


def test_the_enumeration_covers_the_meshes_that_tell_a_transposed_view_apart():
    assert len(CONFIGS) > 100 and len(TP_CASES) > 50 and len(SP_CASES) > 50
    assert (1, 8, 2, "tp") in TP_CASES and (2, 8, 2, "tp") in TP_CASES
    assert (1, 16, 4, "tp") in TP_CASES and (8, 2, 1, "sp") in SP_CASES


@pytest.mark.parametrize("mode", ["tp", "sp"])
def test_partner_groups_equal_the_brute_force(mode):
    """Every valid (sp, tp, kv_heads) with sp * tp <= 16, kv_heads in 1..16: the same groups,
    each ordered by partner index, every rank in exactly one, all of size P."""
    cases = [c for c in CASES if c[3] == mode]
    for sp, tp, kv, _ in cases:
        groups = partner_groups(sp, tp, kv, mode)
        want = expected_groups(sp, tp, kv, mode)
        assert sorted(groups) == sorted(want), (sp, tp, kv, mode)
        assert sorted(g for group in groups for g in group) == list(range(sp * tp))
        p = tp // kv if mode == "tp" else sp
        assert {len(group) for group in groups} == {p}, (sp, tp, kv, mode)
        truth = brute_force(sp, tp, kv, mode)
        for group in groups:
            assert [truth[g][1] for g in group] == list(range(p)), "ordered by partner index"


@pytest.mark.parametrize("sp,tp,kv,mode,named", [
    (1, 4, 4, "tp", ["needs tp > kv_heads"]),
    (2, 6, 4, "tp", ["4 KV heads do not split evenly over tp = 6"]),
    (1, 3, 4, "tp", ["needs tp > kv_heads", "4 KV heads do not split evenly over tp = 3"]),
    (1, 8, 2, "sp", ["SP-mode context parallelism needs sp >= 2"]),
    (2, 2, 1, "xx", ["must be 'tp' or 'sp'"]),
])
def test_partner_groups_refuse_what_cannot_run(sp, tp, kv, mode, named):
    with pytest.raises(ValueError) as error:
        partner_groups(sp, tp, kv, mode)
    for problem in named:
        assert problem in str(error.value)


class StandInMesh:
    """What ``partner_placement`` asks of a DeviceMesh of shape (sp, tp), seen from ``rank``;
    its groups are the tuples of global ranks they hold. Global ranks are shuffled against mesh
    positions (as a hand-built DeviceMesh may be), so positions must go through ``mesh``."""

    device_type = "cpu"

    def __init__(self, sp: int, tp: int, position: int, ranks: torch.Tensor):
        self.sp, self.tp, self.position = sp, tp, position
        self.mesh = ranks.view(sp, tp)

    def size(self, dim: int) -> int:
        return (self.sp, self.tp)[dim]

    def get_local_rank(self, name: str) -> int:
        return self.position // self.tp if name == "sp" else self.position % self.tp

    def get_group(self, name: str) -> tuple[int, ...]:
        s, t = divmod(self.position, self.tp)
        row = self.mesh[:, t] if name == "sp" else self.mesh[s]
        return tuple(row.tolist())


def stand_in_device_mesh(position_rank: int):
    """A stand-in for the DeviceMesh ``partner_placement`` builds over its groups: its
    "partner" group, seen from global rank ``position_rank``, is the row holding that rank."""

    class Built:
        made: list[list[list[int]]] = []

        def __init__(self, device_type, mesh, mesh_dim_names):
            assert mesh_dim_names[-1] == "partner"
            self.rows = mesh.reshape(-1, mesh.shape[-1]).tolist()
            Built.made.append(self.rows)

        def get_group(self, name):
            assert name == "partner"
            return tuple(next(r for r in self.rows if position_rank in r))

    return Built


@pytest.mark.parametrize("sp,tp,kv,mode", [c for c in CASES if c[0] * c[1] in (8, 16)]
                         + [(1, 2, 1, "tp"), (2, 1, 1, "sp"), (1, 4, 2, "tp"), (2, 2, 1, "tp")])
def test_partner_placement_builds_its_group_from_the_brute_force(monkeypatch, sp, tp, kv, mode):
    """Every rank's placement: P, its partner index and a process group over exactly its
    brute-force partners' global ranks; the groups it creates are the same on every rank."""
    world = sp * tp
    ranks = torch.randperm(world, generator=torch.Generator().manual_seed(world * 31 + kv))
    truth = brute_force(sp, tp, kv, mode)
    want = {position: [int(ranks[g]) for g in group]
            for group in expected_groups(sp, tp, kv, mode) for position in group}
    created = []
    for position in range(world):
        built = stand_in_device_mesh(int(ranks[position]))
        monkeypatch.setattr(mesh_module, "DeviceMesh", built)
        placement = partner_placement(StandInMesh(sp, tp, position, ranks), mode, kv)
        _, index, p = truth[position]
        assert (placement.size, placement.rank, placement.mode) == (p, index, mode)
        assert placement.group == tuple(want[position]), (position, placement.group)
        created.append(built.made)
    assert all(made == created[0] for made in created), "every rank creates the same groups"
