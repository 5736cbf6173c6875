"""The one DeviceMesh (axes "sp", "tp"), which TP ranks hold which KV head, and partner groups."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torch_cp.placement import ContextParallel, Mode
from torch_cp.values import positive_int

AXES = ("sp", "tp")


TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_mesh(tp: int = 1, sp: int = 1, device_type: str | None = None) -> DeviceMesh:
    """Build the job's DeviceMesh of shape (sp, tp), axes named ("sp", "tp").

    Args:
        tp, sp: ranks along the TP and SP axes; ``sp * tp`` must be the number of processes.
        device_type: ``"cuda"`` or ``"cpu"``; None: CUDA when ``torch.cuda.is_available()``,
            else CPU.
    Initialises the default process group when it is not yet initialised, NCCL for CUDA and gloo
    otherwise: from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) when it is
    set, else, for ``sp * tp == 1`` in a plain process, a one-rank group of its own.
    ValueError naming every problem (``sp * tp`` ranks without torchrun says how to launch them).
    """
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    problems = [f"{name} must be an int >= 1, got {n!r}" for name, n in (("tp", tp), ("sp", sp))
                if positive_int(n) is None]
    sized = not problems  # tp and sp are ints: their product can be checked
    if device_type not in ("cpu", "cuda"):
        problems.append(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    elif device_type == "cuda" and not torch.cuda.is_available():
        problems.append("device_type 'cuda': CUDA is not available")
    present = [v for v in TORCHRUN_VARIABLES if v in os.environ]
    standalone = not dist.is_initialized() and not present
    if dist.is_initialized():
        world = dist.get_world_size()
    elif present and len(present) < len(TORCHRUN_VARIABLES):
        missing = [v for v in TORCHRUN_VARIABLES if v not in present]
        problems.append(f"the environment sets {', '.join(present)} but not {', '.join(missing)}: "
                        f"launch with torchrun, or unset them for one process")
        world = None
    else:
        world = int(os.environ.get("WORLD_SIZE", 1))
    if sized and standalone and sp * tp > 1:
        problems.append(f"sp * tp = {sp} * {tp} needs {sp * tp} processes: launch with "
                        f"`torchrun --nproc-per-node {sp * tp} ...`")
    elif sized and world is not None and tp * sp != world:
        problems.append(f"sp * tp = {sp} * {tp} = {sp * tp} does not match the world size {world}")
    if problems:
        raise ValueError("invalid mesh: " + "; ".join(problems))
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if standalone:
            # An in-memory store: one rank needs no rendezvous, so no port to race for and no
            # file to clean up.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(backend)
    return init_device_mesh(device_type, (sp, tp), mesh_dim_names=AXES)


@dataclass(frozen=True)
class KVHeadLayout:
    """Which KV heads each of ``tp`` ranks holds.

    With ``tp <= kv_heads`` rank r holds heads ``[r * kv_heads // tp, (r + 1) * kv_heads // tp)``.
    With ``tp > kv_heads`` each head is replicated over ``replicas = tp // kv_heads`` consecutive
    ranks: rank r holds head ``r // replicas``, which matches a contiguous split of the query heads.
    """

    kv_heads: int
    tp: int

    @property
    def replicas(self) -> int:
        return max(1, self.tp // self.kv_heads)

    @property
    def heads_per_rank(self) -> int:
        return max(1, self.kv_heads // self.tp)

    def heads_of(self, tp_rank: int) -> range:
        if self.tp > self.kv_heads:
            head = tp_rank // self.replicas
            return range(head, head + 1)
        return range(tp_rank * self.heads_per_rank, (tp_rank + 1) * self.heads_per_rank)

    def partner_index(self, tp_rank: int) -> int:
        """Index of ``tp_rank`` among the ranks that hold its KV head."""
        return tp_rank % self.replicas


def kv_head_replicas(num_kv_heads: int, tp: int) -> KVHeadLayout:
    """Decide which TP ranks hold which KV head; ValueError unless the heads split evenly."""
    if num_kv_heads < 1 or tp < 1:
        raise ValueError(f"need num_kv_heads >= 1 and tp >= 1, got {num_kv_heads} and {tp}")
    if num_kv_heads % tp != 0 and tp % num_kv_heads != 0:
        raise ValueError(
            f"{num_kv_heads} KV heads do not split evenly over tp = {tp}: "
            f"one must divide the other")
    return KVHeadLayout(num_kv_heads, tp)


def context_parallel_problems(mode: Mode, num_kv_heads: int, tp: int, sp: int) -> list[str]:
    """Why context parallelism cannot run in ``mode`` on this mesh (empty when it can)."""
    if mode == "tp" and tp <= num_kv_heads:
        return [f"TP-mode context parallelism needs tp > kv_heads so that ranks share a KV head; "
                f"got tp = {tp}, kv_heads = {num_kv_heads}"]
    if mode == "sp" and sp < 2:
        return [f"SP-mode context parallelism needs sp >= 2, got sp = {sp}"]
    if mode not in ("tp", "sp"):
        return [f"context-parallel mode must be 'tp' or 'sp', got {mode!r}"]
    return []


def _partner_problems(mode: Mode, num_kv_heads: int, tp: int, sp: int) -> list[str]:
    """Why partner groups cannot be formed in ``mode`` on an (sp, tp) mesh (empty when they can)."""
    problems = context_parallel_problems(mode, num_kv_heads, tp, sp)
    if mode == "tp":
        try:
            kv_head_replicas(num_kv_heads, tp)
        except ValueError as e:
            problems.append(str(e))
    return problems


def partner_groups(sp: int, tp: int, num_kv_heads: int, mode: Mode) -> list[list[int]]:
    """Every partner group of an (sp, tp) mesh, each ordered by partner index.

    Ranks are mesh positions ``sp_index * tp + tp_index`` (DeviceMesh's row-major order over
    ``AXES``), so they are global ranks for a mesh from ``init_mesh``. TP mode: the TP ranks of
    one SP index that hold the same KV head, ``replicas = tp // num_kv_heads`` consecutive ones
    (MLA: pass 1 head, so all TP ranks), partner index ``tp_index % replicas``. SP mode: the SP
    ranks of one TP index, partner index ``sp_index``. Every rank is in exactly one group.
    ValueError (naming every problem) when context parallelism cannot run so.
    """
    problems = _partner_problems(mode, num_kv_heads, tp, sp)
    if problems:
        raise ValueError("; ".join(problems))
    grid = torch.arange(sp * tp).view(sp, tp)
    if mode == "sp":
        return grid.t().tolist()
    replicas = kv_head_replicas(num_kv_heads, tp).replicas
    return grid.view(sp, tp // replicas, replicas).reshape(-1, replicas).tolist()


def mesh_world_problems(mesh: DeviceMesh) -> list[str]:
    """A mesh that is not the whole world in rank order. Context parallelism's partner groups
    are created collectively by every rank of the world, and the calls' agreement and rank 0's
    broadcasts span the world (so a mesh of one replica among several would wait on the
    others). A rank's coordinates are read with ``DeviceMesh.get_local_rank``, its rank within
    each axis's group, which is its position on the axis only where ranks increase along it
    (helper 77: a mesh of ranks [[0, 2, 1, 3]] paired partners holding other KV heads)."""
    if not dist.is_initialized():  # no process group: nothing spans ranks
        return []
    ranks = mesh.mesh.flatten().tolist()
    if len(ranks) != dist.get_world_size():
        return [f"the mesh spans {len(ranks)} ranks, not the whole world of "
                f"{dist.get_world_size()}: build it with torch_cp.init_mesh (one model replica "
                f"a job)"]
    if ranks != sorted(ranks):
        return [f"the mesh's ranks {mesh.mesh.tolist()} do not increase along its axes: build "
                f"it with torch_cp.init_mesh"]
    return []


def partner_placement(mesh: DeviceMesh | None, mode: Mode, num_kv_heads: int) -> ContextParallel:
    """This rank's placement: TP mode over the TP ranks sharing its KV head (MLA: pass 1 head, so
    all TP ranks), SP mode over the SP ranks of its TP index (the groups of ``partner_groups``).

    Call it on every rank of the mesh: where partners are fewer than the TP ranks, every rank
    creates every partner group (the same collective calls on each)."""
    if mesh is None:
        return ContextParallel.single()
    tp, sp = mesh.size(AXES.index("tp")), mesh.size(AXES.index("sp"))
    problems = _partner_problems(mode, num_kv_heads, tp, sp) + mesh_world_problems(mesh)
    if problems:
        raise ValueError("; ".join(problems))
    groups = partner_groups(sp, tp, num_kv_heads, mode)
    me = mesh.get_local_rank("sp") * tp + mesh.get_local_rank("tp")
    mine = next(g for g in groups if me in g)
    if mode == "sp":  # the mesh's own groups along "sp" and "tp" are these groups
        group = mesh.get_group("sp")
    elif len(mine) == tp:
        group = mesh.get_group("tp")
    else:
        ranks = mesh.mesh.flatten()[torch.tensor(groups)]  # mesh positions -> global ranks
        partners = DeviceMesh(mesh.device_type, ranks, mesh_dim_names=("kv", "partner"))
        group = partners.get_group("partner")
    return ContextParallel(len(mine), mine.index(me), mode, group)
