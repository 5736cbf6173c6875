"""What both benchmarks share: the run's environment, the copy bandwidth, timers, a time budget,
incremental JSON results and the summary table."""

from __future__ import annotations

import ast
import datetime
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch


def versions() -> dict:
    """Versions of everything whose speed the numbers depend on."""
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda}
    for name in ("transformers", "flashinfer", "triton"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # absent, or a broken install: record that, measure the rest
            out[name] = None
    return out


def machine(device: torch.device) -> dict:
    out = {"host": platform.node(), "cpu_count": os.cpu_count(), "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(gpu=props.name, sms=props.multi_processor_count,
                   gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}")
    return out


def run_header(device: torch.device) -> dict:
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
            "machine": machine(device), "versions": versions()}


def _literal(value: str):
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value


def _apply(text: str, owner_of: Callable[[str], tuple[object, str] | None], flag: str) -> dict:
    """Set each 'name=value' of ``text`` (comma-separated; values as Python literals, anything
    else a string) on the owner ``owner_of(name)`` gives, and return the settings; an unknown
    name exits before anything is set."""
    settings, targets = {}, {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        target = owner_of(name)
        if target is None or not hasattr(*target):
            raise SystemExit(f"{flag}: no setting {name!r}")
        targets[name], settings[name] = target, _literal(value)
    for name, value in settings.items():
        setattr(*targets[name], value)
    return settings


def apply_inductor_settings(text: str) -> dict:
    """Set ``torch._inductor.config`` from 'name=value,...' (dotted names reach its sections,
    e.g. ``triton.enable_pdl``) and return the settings."""
    import torch._inductor.config as inductor_config

    def owner_of(name: str):
        *sections, leaf = name.split(".")
        owner = inductor_config
        for section in sections:
            owner = getattr(owner, section, None)
        return None if owner is None else (owner, leaf)

    return _apply(text, owner_of, "--inductor")


def apply_kernel_settings(text: str) -> dict:
    """Set module-level settings of torch_cp's kernels, which they read at each call, from
    'module.NAME=value,...' (e.g. ``torch_cp.graphs.fused_router.ROUTE_WARPS=4``), and return
    them."""
    import importlib

    def owner_of(name: str):
        module, _, leaf = name.rpartition(".")
        if not module.startswith("torch_cp.") or not leaf.isupper():
            return None
        try:
            return importlib.import_module(module), leaf
        except ImportError:
            return None

    return _apply(text, owner_of, "--kernel")


KERNEL_HELP = ("torch_cp's kernel settings, 'module.NAME=value,...', e.g. "
               "'torch_cp.graphs.fused_router.ROUTE_WARPS=4' (upper-case module constants the "
               "kernels read at each call)")


DECODE_KERNEL_HELP = ("torch_cp's GQA decode kernel: 'flashinfer', 'triton', 'auto' (Triton for "
                      "one-token steps over short rows), or 'triton:B:W:P[:S]' (the Triton "
                      "kernels at one tile for every step: context tokens a block, warps, "
                      "programs an SM, pipeline stages; decode_kernels --triton sweeps them)")


def triton_tile(spec: str) -> tuple[int, int, int, int | None]:
    """``"B:W:P[:S]"`` -> (block, warps, programs an SM, stages or None)."""
    parts = spec.split(":")
    try:
        block, warps, per_sm, *rest = map(int, parts)
    except ValueError:
        raise SystemExit(f"a Triton tile is 'B:W:P[:S]' in integers, got {spec!r}") from None
    if len(rest) > 1 or block < 16 or block & (block - 1) or warps < 1 or per_sm < 1:
        raise SystemExit(f"a Triton tile is 'B:W:P[:S]' with B a power of two from 16, got "
                         f"{spec!r}")
    return block, warps, per_sm, (rest[0] or None) if rest else None


LINEARS_HELP = ("a one-token linear's kernel in compiled steps: 'gemv' (torch_cp.gemv, the "
                "default) or 'cublas' (F.linear)")


def apply_linears(choice: str | None) -> str:
    """Set torch_cp's one-token linears from ``--linears`` (``LINEARS_HELP``) and return what
    the results record."""
    from torch_cp import gemv

    if choice not in (None, "gemv", "cublas"):
        raise SystemExit(f"--linears: {LINEARS_HELP}; got {choice!r}")
    if choice:
        gemv.ENABLED = choice == "gemv"
    return "gemv" if gemv.ENABLED else "cublas"


def apply_decode_kernel(spec: str | None) -> str:
    """Set torch_cp's GQA decode kernel from ``--decode-kernel`` (``DECODE_KERNEL_HELP``) and
    return what the results record."""
    from torch_cp.attention import flashinfer_gqa

    if not spec:
        return flashinfer_gqa.DECODE_KERNEL  # torch_cp's default
    kind, _, tile = spec.partition(":")
    if kind not in flashinfer_gqa.DECODE_KERNELS or (tile and kind != "triton"):
        raise SystemExit(f"--decode-kernel: {DECODE_KERNEL_HELP}; got {spec!r}")
    values = triton_tile(tile) if tile else None  # refused before anything is set
    flashinfer_gqa.DECODE_KERNEL = kind
    if values:
        from torch_cp.attention import triton_decode

        (triton_decode.BLOCK_N, triton_decode.WARPS, triton_decode.PROGRAMS_PER_SM,
         triton_decode.STAGES) = values
        triton_decode.ONE_TOKEN_TILE = None  # the tile given for every step
    return spec


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, iters: int = 50,
            warmup: int = 5) -> float:
    """Mean milliseconds of ``fn`` over ``iters`` back-to-back calls (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e3 / iters
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / iters


def graph_time_ms(fn: Callable[[], object], device: torch.device, iters: int = 50,
                  per_graph: int = 10) -> float:
    """Mean milliseconds of ``fn`` replayed from a CUDA graph of ``per_graph`` calls: kernel time
    without launch overhead, as inside a captured decode step."""
    graph = captured(fn, device, calls=per_graph)
    reps = max(1, iters // per_graph)
    return time_ms(graph.replay, device, iters=reps, warmup=2) / per_graph


def captured(fn: Callable[[], object], device: torch.device, calls: int = 1
             ) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` calls of ``fn``, captured after three warm-up calls on a side
    stream."""
    assert device.type == "cuda"
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    return graph


def kernel_times(fn: Callable[[], object], device: torch.device) -> dict[str, tuple[float, int]]:
    """One call of ``fn`` under torch.profiler: milliseconds and calls of each kernel by name
    (on the CPU, of each operator, by its self time)."""
    from torch.profiler import DeviceType, ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        fn()
        sync(device)
    times: dict[str, tuple[float, int]] = {}
    for event in prof.key_averages():
        if on_gpu and event.device_type != DeviceType.CUDA:
            continue
        ms = (event.self_device_time_total if on_gpu else event.self_cpu_time_total) / 1e3
        if ms > 0:
            before_ms, before_calls = times.get(event.key, (0.0, 0))
            times[event.key] = (before_ms + ms, before_calls + event.count)
    return times


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    n = int(gib * 2**30) // 2 if device.type == "cuda" else 1 << 22
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, iters=20 if device.type == "cuda" else 3)
    return 2 * n * 2 / (ms * 1e-3)


class Budget:
    """Seconds left before a deadline, so a run skips what it cannot finish instead of being
    killed with nothing written."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def allows(self, seconds: float) -> bool:
        return self.left() >= seconds


class Results:
    """The run's header plus a list of records, rewritten to ``path`` after every record."""

    def __init__(self, path: str | Path | None, header: dict):
        self.path = Path(path) if path else None
        self.data = dict(header, records=[])

    def add(self, **record) -> dict:
        self.data["records"].append(record)
        self.save()
        return record

    def save(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.data, indent=1, default=str))


def fmt(value, digits: int = 3, missing: str = "-") -> str:
    if value is None:
        return missing
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 10 ** digits else f"{value:.0f}"
    return str(value)


def table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """A plain-text table of ``rows`` (dicts) over ``columns``."""
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def free_cuda(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def torchrun_setup(smoke: bool) -> tuple[torch.device, int, int]:
    """(device, world, rank) of a process torchrun launched: its CUDA device and NCCL, or the CPU
    and gloo with ``smoke`` or without CUDA; the default process group initialised."""
    import datetime
    import os

    import torch.distributed as dist

    cuda = torch.cuda.is_available() and not smoke
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=600))
    return device, dist.get_world_size(), dist.get_rank()


def appending_results(path: str | None, rank: int, device: torch.device) -> Results:
    """Rank 0's ``Results`` to ``path``, after the records already there (each job of a series
    appends its own); other ranks write nothing."""
    import json

    results = Results(path if rank == 0 else None, run_header(device))
    if path and rank == 0 and Path(path).exists():
        results.data["records"] = json.loads(Path(path).read_text())["records"]
    return results
