"""Run a function on P gloo ranks spawned with torch.multiprocessing and collect what each returns.

A spawn costs seconds, so a test module spawns once and runs all its cases inside the ranks.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import sys
import tempfile
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, fn, args, folder: str) -> None:
    # A rank killed by a signal (a crash in native code) prints its Python stack to stderr.
    faulthandler.enable()
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=300))
    try:
        result = ("ok", fn(rank, world_size, *args))
        dist.barrier()
    except BaseException:
        result = ("error", traceback.format_exc())
    finally:
        dist.destroy_process_group()
    with open(os.path.join(folder, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    # Leave without the interpreter's finalization, where a gloo worker thread still releasing
    # tensors can abort the process (pytorch/pytorch#190489). The result is on disk: exiting
    # loses nothing. (CI's two rank crashes were mid-step, inside functional collectives over
    # gloo, which eager steps no longer use: compat.gather_dim0.)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(world_size: int, fn, *args) -> list:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, each in its own gloo rank.

    ``fn`` must be a module-level function; its result must pickle (CPU tensors, plain data).
    """
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_worker, args=(world_size, fn, args, folder), nprocs=world_size, join=True)
        outcomes = []
        for rank in range(world_size):
            with open(os.path.join(folder, f"rank{rank}.pkl"), "rb") as f:
                outcomes.append(pickle.load(f))
    errors = [f"rank {r}:\n{value}" for r, (status, value) in enumerate(outcomes)
              if status == "error"]
    if errors:
        # A crash on one rank shows up on its peers as a closed connection: lead with the cause.
        errors.sort(key=lambda e: "Connection closed by peer" in e)
        raise RuntimeError("\n".join(errors))
    return [value for _, value in outcomes]


def ranks_by_world(fn, cases) -> Callable[[int], list]:
    """``world -> run_ranks(world, fn, the cases whose .world is world)``, each world size
    spawned once, on first use (for a module-scoped fixture)."""
    spawned = {}

    def results(world: int) -> list:
        if world not in spawned:
            spawned[world] = run_ranks(world, fn, [c for c in cases if c.world == world])
        return spawned[world]
    return results
