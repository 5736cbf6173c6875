"""torch_cp.generate at P = 2 (TP mode over tp = 2, SP mode over sp = 2; gloo ranks) gives the
tokens of P = 1 and of the unpatched model, sampling agrees on every rank, each rank holds half
the KV bytes, and planning each step ahead changes nothing; TP over 2 ranks without context
parallelism (P = 1) gives the same tokens with the KV head copied; model.generate of a
left-padded batch at P = 2 gives the unpatched model's tokens; ranks that patch, build an
engine or call generate or model.generate differently all raise the same ValueError. The ranks
are spawned once for the module; every case runs inside them."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from multirank import run_ranks

import torch_cp
from torch_cp.engine import Engine
from torch_cp.engine.sampling import SamplingParams
from torch_cp.mesh import init_mesh
from torch_cp.tiny import tiny_qwen3

pytestmark = pytest.mark.slow  # spawns gloo ranks

PROMPTS = [[42], [200, 3, 150, 7, 99], list(range(1, 20)), [],
           [(7 * i) % 300 + 1 for i in range(27)]]
NEW = 8
PAGES, PAGE = 10, 8  # lifetimes of 1, 2, 4, 5 pages: the 27-token prompt waits
BUDGET = 6  # tokens a step: prompts prefill in chunks
SAMPLING = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, seed=11)
MESHES = {"tp": dict(tp=2, sp=1), "sp": dict(tp=1, sp=2)}
# TP over 2 ranks without context parallelism: the one KV head is copied on both (P = 1).


def _generate(model):
    """(greedy results, sampled results, sampled without the rank-0 broadcast, kv bytes, free)."""
    engine = Engine(model, PAGES, PAGE, BUDGET)
    greedy = engine.run(PROMPTS, NEW)
    sampled = engine.run(PROMPTS, NEW, SAMPLING)
    engine.broadcast = False  # each rank samples on its own: the same seed must agree
    local = engine.run(PROMPTS, NEW, SAMPLING)
    return ([r.token_ids for r in greedy], [r.finish_reason for r in greedy],
            [r.token_ids for r in sampled], [r.token_ids for r in local],
            engine.kv_bytes, engine.allocator.free_pages)


def _through_buckets(model) -> tuple[list, int, int]:
    """(tokens, steps replayed, free pages after) of an engine stepping through buckets
    (``cpu_graphs``: the runner's static plans replayed by an eager forward), launching ahead:
    padding rows and stale table columns exchanged between the partners too."""
    from cpu_graphs import with_eager_buckets

    from torch_cp.graphs import default_buckets

    engine = Engine(model, PAGES, PAGE, BUDGET, overlap_planning=True)
    with_eager_buckets(engine, default_buckets(4, 8, mixed=[(4, BUDGET)]))
    tokens = [r.token_ids for r in engine.run(PROMPTS, NEW)]
    return tokens, engine.replayed_steps, engine.allocator.free_pages


def _pool_cap(model, rank: int) -> int:
    """The default pool's page cap when the ranks see different free host memory."""
    from torch_cp.engine import memory

    free = memory.free_host_bytes
    memory.free_host_bytes = lambda: (rank + 1) * 2**20
    try:
        return memory.memory_cap_pages(model.torch_cp, PAGE)
    finally:
        memory.free_host_bytes = free


def _ranks(rank: int, world_size: int):
    out = {}
    for mode, sizes in MESHES.items():
        mesh = init_mesh(**sizes, device_type="cpu")
        model = torch_cp.patch_model(tiny_qwen3(), context_parallel=True, mesh=mesh, mode=mode,
                                     page_size=PAGE)
        assert model.torch_cp.placement.size == 2
        out[mode] = _generate(model)
        out[f"{mode} model.generate"] = _hf_generate(model)
        out[f"{mode} out of memory"] = _out_of_memory_on_rank_1(model, rank)
        out[f"{mode} next turn"] = _next_turn(model)
        out[f"{mode} capture out of memory"] = _capture_out_of_memory_on_rank_1(model, rank)
        records = []
        model.torch_cp.exchange.records = records
        engine = Engine(model, PAGES, PAGE, BUDGET, overlap_planning=True)
        tokens = [r.token_ids for r in engine.run(PROMPTS, NEW)]
        model.torch_cp.exchange.records = None
        out[f"{mode} overlap"] = (tokens, engine.launched_ahead_steps,
                                  [(r.op, r.shape) for r in records])
        out[f"{mode} pool cap"] = _pool_cap(model, rank)
        out[f"{mode} buckets"] = _through_buckets(model)
    mesh = init_mesh(tp=2, sp=1, device_type="cpu")
    model = torch_cp.patch_model(tiny_qwen3(), mesh=mesh, page_size=PAGE)
    assert model.torch_cp.placement.size == 1 and model.torch_cp.tp == 2
    out["tp, no cp"] = _generate(model)
    out["disagree"] = [_refusal(model, [[9, 8, 7 - rank]], NEW),  # other prompts on each rank
                       _refusal(model, [[9, 8, 7]], "x" if rank else NEW)]  # a bad one on rank 1
    try:
        Engine(model, PAGES, PAGE, BUDGET).run([[9, 8, 7 - rank]], NEW)
        out["disagree"].append("ran")
    except ValueError as e:
        out["disagree"].append(str(e))
    out["refusals"] = _refusals(rank)
    out["patch out of memory"] = _patch_out_of_memory_on_rank_1(rank)
    return out


def _patch_out_of_memory_on_rank_1(rank: int) -> dict:
    """Rank 1 alone runs out of memory fusing the MLPs' weights, in SP mode (nothing sharded:
    then both ranks patch again and generate) and over TP (both sharded their weights: then
    patching again is refused on both)."""
    from torch_cp.hf import patch

    fuse = patch.fuse_gate_up

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (rank 1 alone, in this test)")
    out = {}
    for mode, sizes in MESHES.items():
        mesh, model = init_mesh(**sizes, device_type="cpu"), tiny_qwen3()
        patch.fuse_gate_up = out_of_memory if rank == 1 else fuse
        try:
            torch_cp.patch_model(model, context_parallel=True, mesh=mesh, mode=mode,
                                 page_size=PAGE)
            out[mode] = "ran"
        except torch.OutOfMemoryError as e:
            out[mode] = f"OutOfMemoryError: {e}"
        finally:
            patch.fuse_gate_up = fuse
        try:
            model = torch_cp.patch_model(model, context_parallel=True, mesh=mesh, mode=mode,
                                         page_size=PAGE)
            out[f"{mode} again"] = [r.token_ids for r in torch_cp.generate(
                model, PROMPTS, NEW, num_pages=PAGES, page_size=PAGE, progress=False)]
        except ValueError as e:
            out[f"{mode} again"] = str(e)
    return out


def _raised(call, *args, **kwargs) -> str:
    """The ValueError ``call`` raised, else "ran"."""
    try:
        call(*args, **kwargs)
    except ValueError as e:
        return str(e)
    return "ran"


def _raised_any(call, *args, **kwargs) -> str:
    """The exception ``call`` raised, else the tokens it returned."""
    try:
        return str(call(*args, **kwargs)[0].tolist())
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


class _ClosedAfter:
    """A streamer whose output closes after ``n`` puts."""

    def __init__(self, n: int):
        self.left = n

    def put(self, value) -> None:
        self.left -= 1
        if self.left < 0:
            raise BrokenPipeError(32, "Broken pipe (in this test)")

    def end(self) -> None:
        pass


def _refusals(rank: int) -> dict[str, str]:
    """What each rank raises when the ranks patch, build an engine or call ``model.generate``
    with arguments that differ, or that are bad (or do not fit) on rank 1 only. Each gather
    keeps the ranks in step: the last call, agreed, runs."""
    from torch_cp.engine import memory

    mesh = init_mesh(tp=2, sp=1, device_type="cpu")

    def patch(model, **kwargs):
        return torch_cp.patch_model(model, **{"mesh": mesh, "context_parallel": True,
                                              "page_size": PAGE, **kwargs})
    out = {"patch context_parallel": _raised(patch, tiny_qwen3(), context_parallel=rank == 0),
           "patch no mesh": _raised(patch, tiny_qwen3(), mesh=None if rank else mesh),
           "patch page_size bad": _raised(patch, tiny_qwen3(), page_size=3 if rank else PAGE),
           "patch dtype": _raised(patch, tiny_qwen3(dtype=torch.bfloat16 if rank else
                                                    torch.float32)),
           "patch config": _raised(patch, tiny_qwen3(num_hidden_layers=2 + rank))}
    # helper 77: partners paired by mesh position, shards by group rank (wrong tokens); a
    # replica's sub-mesh without context parallelism, whose calls then waited on the world
    from torch.distributed.device_mesh import DeviceMesh

    swapped = DeviceMesh("cpu", torch.tensor([[1, 0]]), mesh_dim_names=("sp", "tp"))
    out["patch swapped mesh"] = _raised(patch, tiny_qwen3(), mesh=swapped)
    one = DeviceMesh("cpu", torch.tensor([[rank]]), mesh_dim_names=("sp", "tp"))
    out["patch one-rank mesh"] = _raised(patch, tiny_qwen3(), mesh=one, context_parallel=False)
    out["patch context_parallel str"] = _raised(patch, tiny_qwen3(), context_parallel="False")
    model = patch(tiny_qwen3())
    out["Engine max_rows"] = _raised(Engine, model, PAGES, PAGE, max_rows=4 + rank)
    out["Engine max_rows bad"] = _raised(Engine, model, PAGES, PAGE, max_rows=0 if rank else 4)
    out["Engine max_rows bad on both"] = _raised(Engine, model, PAGES, PAGE, max_rows=0)
    with warnings.catch_warnings(record=True) as caught:  # one warning, from rank 0 (helper 69)
        warnings.simplefilter("always")
        torch_cp.generate(model, [[9, 8, 7]], 1, top_k=5, progress=False)
    out["warnings"] = [type(w.message).__name__ for w in caught]
    free = memory.free_host_bytes
    memory.free_host_bytes = (lambda: 0) if rank else free  # rank 1 has no memory to spare
    try:
        out["Engine pool does not fit"] = _raised(Engine, model, PAGES, PAGE)
    finally:
        memory.free_host_bytes = free
    # A bad num_pages on one rank met the others' pool-fit all_reduce with its gather: a hang.
    out["generate num_pages bad"] = _raised(torch_cp.generate, model, [[9, 8, 7]], NEW,
                                            num_pages=0 if rank else PAGES, progress=False)
    # Raised on rank 1 alone before its gather, leaving rank 0 in it (helper 68).
    out["Engine.run string without tokenizer"] = _raised(
        Engine(model, PAGES, PAGE).run, "nine eight" if rank else [[9, 8, 7]], NEW)
    out["generate eos float"] = _raised(torch_cp.generate, model, [[9, 8, 7]], NEW,
                                        eos_token_id=1.5 if rank else None, progress=False)
    ids = torch.tensor([[9, 8, 7]])
    memory.free_host_bytes = (lambda: 0) if rank else free  # rank 1 short of memory again
    try:  # its cache refused on rank 1 alone, rank 0 went on into the first forward's gather
        out["model.generate pool does not fit"] = _raised(model.generate, ids, do_sample=False,
                                                          max_new_tokens=NEW)
    finally:
        memory.free_host_bytes = free
    shown = transformers.TextStreamer(_Decoder()) if rank == 0 else None  # shows, on rank 0
    out["model.generate streamer on rank 0"] = model.generate(
        ids, max_new_tokens=NEW, do_sample=False, streamer=shown)[0].tolist()
    # A streamer on rank 0 whose output closed mid-call left rank 1 in the step's collective.
    out["model.generate streamer raising on rank 0"] = _raised_any(
        model.generate, ids, max_new_tokens=NEW, do_sample=False,
        streamer=_ClosedAfter(2) if rank == 0 else None)
    out["model.generate streamer raising on rank 0, by position"] = _raised_any(
        model.generate, ids, None, None, None, None, None, None,  # generate's 8th: streamer
        _ClosedAfter(2) if rank == 0 else None, max_new_tokens=NEW, do_sample=False)
    # new_cache raised alone on the rank given a bad size; ranks sized alike each other.
    out["new_cache max_length"] = _raised(torch_cp.new_cache, model, 1, 16 + rank)
    out["new_cache batch_size bad"] = _raised(torch_cp.new_cache, model, 0 if rank else 1, 16)
    out["model.generate inputs"] = _raised(model.generate, ids + rank, max_new_tokens=NEW,
                                           do_sample=False)
    out["model.generate max_new_tokens"] = _raised(model.generate, ids, do_sample=False,
                                                   max_new_tokens=NEW + rank)
    # The same type with other settings (helper 72: rank 0 stopped early, rank 1 hung)
    from transformers import MaxLengthCriteria, StoppingCriteriaList

    out["model.generate stopping_criteria"] = _raised(
        model.generate, ids, max_new_tokens=NEW, do_sample=False,
        stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(ids.shape[1] + 2 + rank)]))
    model.generation_config.max_new_tokens = NEW + rank
    out["model.generate generation_config"] = _raised(model.generate, ids, do_sample=False)
    model.generation_config.max_new_tokens = NEW
    if rank:
        model.to(torch.float64)  # cast after patching, on rank 1 alone: refused on both
    out["Engine cast"] = _raised(Engine, model, PAGES, PAGE)
    out["generate cast"] = _raised(torch_cp.generate, model, [[9, 8, 7]], NEW, progress=False)
    out["model.generate cast"] = _raised(model.generate, ids, max_new_tokens=NEW,
                                         do_sample=False)
    model.to(torch.float32)
    out["agreed"] = model.generate(ids, do_sample=False)[0].tolist()
    return out


class _Decoder:
    """What a ``TextStreamer`` asks of its tokenizer."""

    def decode(self, ids, **kwargs) -> str:
        return " ".join(map(str, ids))


def _refusal(model, prompts, new) -> str:
    try:
        torch_cp.generate(model, prompts, new, progress=False)
    except ValueError as e:
        return str(e)
    return "ran"


def _hf_generate(model) -> list[list[int]]:
    """``model.generate`` of the patched model on a left-padded batch of the non-empty prompts."""
    prompts = [p for p in PROMPTS if p]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    return [row[width:].tolist() for row in out]


def _next_turn(model) -> list[list[int]]:
    """A conversation's second turn: ``model.generate`` given the first turn's cache, which
    grows past the pages it was made with (every rank alike)."""
    ids = torch.tensor([PROMPTS[0]])
    first = model.generate(ids, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    seq = torch.cat([first.sequences, torch.tensor([list(range(20, 50))])], 1)
    cache = first.get("cache", first.get("past_key_values"))
    out = model.generate(seq, cache=cache, max_new_tokens=NEW, do_sample=False)
    return out[0, seq.shape[1]:].tolist()


def _out_of_memory_on_rank_1(model, rank: int) -> dict[str, str]:
    """What each rank raises when rank 1 alone runs out of memory allocating an engine's pools,
    a generate cache, and growing that cache for a conversation's next turn; then the next
    turn, retried with the memory back, runs from the cache as it was (``_next_turn``'s)."""
    runtime = model.torch_cp
    new_pool = runtime.new_pool

    def out_of_memory(num_pages, page_size=None, device=None):
        if device == "meta":  # sizing a pool (the free-memory checks) allocates nothing
            return new_pool(num_pages, page_size, device)
        raise torch.OutOfMemoryError("CUDA out of memory (rank 1 alone, in this test)")

    def with_rank_1_out_of_memory(call) -> str:
        if rank == 1:
            runtime.new_pool = out_of_memory  # the instance's, over the class's method
        try:
            call()
        except torch.OutOfMemoryError as e:
            return f"OutOfMemoryError: {e}"
        finally:
            runtime.__dict__.pop("new_pool", None)
        return "ran"

    ids = torch.tensor([PROMPTS[0]])
    out = {"engine": with_rank_1_out_of_memory(lambda: Engine(model, PAGES, PAGE, BUDGET)),
           "generate": with_rank_1_out_of_memory(
               lambda: model.generate(ids, max_new_tokens=2, do_sample=False))}
    first = model.generate(ids, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    seq = torch.cat([first.sequences, torch.tensor([list(range(20, 50))])], 1)
    cache = first.get("cache", first.get("past_key_values"))
    out["grow"] = with_rank_1_out_of_memory(
        lambda: model.generate(seq, cache=cache, max_new_tokens=NEW, do_sample=False))
    retried = model.generate(seq, cache=cache, max_new_tokens=NEW, do_sample=False)
    out["retried next turn"] = retried[0, seq.shape[1]:].tolist()
    return out


def _capture_out_of_memory_on_rank_1(model, rank: int) -> tuple[str, list]:
    """What each rank raises, and which buckets it warmed up, when rank 1 alone runs out of
    memory capturing the second of three buckets' graphs. The CUDA parts are stand-ins (no GPU
    here): the order of warm-ups, captures and the agreement is what is tested."""
    from torch_cp.graphs import runner as runner_module
    from torch_cp.plan import Bucket

    runner = runner_module.CUDAGraphRunner(model, torch_cp.new_cache(model, 1, 8),
                                           [Bucket(1, 1, 4), Bucket(2, 2, 4), Bucket(4, 4, 4)])
    warmed = []

    def warmed_up(bucket, stream):
        warmed.append((bucket.rows, bucket.tokens, bucket.max_pages))
        return bucket

    def record(bucket, pool, stream):
        if rank == 1 and bucket == Bucket(2, 2, 4):
            raise torch.OutOfMemoryError("CUDA out of memory (rank 1 alone, in this test)")

    runner._warmed, runner._record = warmed_up, record
    stream_of, pool_handle = runner_module.capture_stream, torch.cuda.graph_pool_handle
    runner_module.capture_stream, torch.cuda.graph_pool_handle = (lambda device: None,
                                                                  lambda: None)
    try:
        runner.capture()
        return "ran", warmed
    except torch.OutOfMemoryError as e:
        return f"OutOfMemoryError: {e}", warmed
    finally:
        runner_module.capture_stream, torch.cuda.graph_pool_handle = stream_of, pool_handle


@pytest.fixture(scope="module")
def single():
    return _generate(torch_cp.patch_model(tiny_qwen3(), page_size=PAGE))


@pytest.fixture(scope="module")
def hf():
    model = tiny_qwen3()
    return [tuple(model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False)[
        0, len(p):].tolist()) if p else () for p in PROMPTS]


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(2, _ranks)


@pytest.mark.parametrize("mode", [*MESHES, "tp, no cp"])
def test_greedy_tokens_equal_p1_and_hf(ranks, single, hf, mode):
    assert single[0] == hf  # the empty prompt (request 3) gives () and an error
    assert single[1][3] == "error"
    for rank, per_mode in enumerate(ranks):
        tokens, reasons = per_mode[mode][:2]
        assert tokens == hf, f"rank {rank}"
        assert reasons == single[1], f"rank {rank}"


@pytest.mark.parametrize("mode", MESHES)
def test_steps_through_buckets_give_the_same_tokens(ranks, hf, mode):
    for rank, per_mode in enumerate(ranks):
        tokens, replayed, free = per_mode[f"{mode} buckets"]
        assert tokens == hf, f"rank {rank}"
        assert replayed >= 8 and free == PAGES, f"rank {rank}"


@pytest.mark.parametrize("mode", [*MESHES, "tp, no cp"])
def test_sampling_is_identical_on_every_rank(ranks, single, mode):
    sampled = [per_mode[mode][2] for per_mode in ranks]
    local = [per_mode[mode][3] for per_mode in ranks]
    assert sampled[0] == sampled[1]
    assert local[0] == local[1], "same seed, each rank sampling alone"
    # P = 2 logits differ from P = 1 only by float32 rounding (merged partials); a draw falling
    # within ~1e-6 of a category boundary would differ, far rarer than these 40 draws.
    assert sampled[0] == single[2]
    assert sampled[0] != single[0], "temperature 1 differs from greedy"


def test_ranks_called_with_different_arguments_all_refuse_naming_them(ranks):
    """Other prompts on each rank gave the same wrong tokens on both, silently; an argument bad
    on one rank left the other waiting in a collective (helper 65)."""
    for rank, per_mode in enumerate(ranks):
        prompts, bad, engine = per_mode["disagree"]
        assert prompts == ("the ranks called generate with different prompts: every rank must "
                           "pass the same arguments"), f"rank {rank}"
        assert engine.startswith("the ranks called Engine.run with different prompts")
        assert "max_new_tokens must be an int or one int a prompt, got 'x'" in bad
        assert bad.startswith("rank 1: ") == (rank == 0), f"rank {rank}: {bad}"


DIFFERENT = "the ranks called {} with different {}: every rank must pass the same arguments"
CAST = "the model was cast to torch.float64 after torch_cp.patch_model"


def test_ranks_that_patch_build_or_call_model_generate_differently_all_refuse(ranks):
    """Before their gathers, a rank patched otherwise hung (other context_parallel), died in
    gloo (another dtype) or gave wrong tokens; an Engine of other max_rows or prefix_caching
    hung or died; model.generate of other inputs gave the same wrong tokens on both, silently,
    and of other lengths died; a problem on rank 1 alone (a bad page size or max_rows, a pool
    its free memory cannot hold, model.generate's cache likewise (helper 118), a model cast after
    patching, a bad new_cache size) left rank 0 in its next collective."""
    for rank, per_mode in enumerate(ranks):
        got = per_mode["refusals"]
        for key, call, named in [
                ("patch context_parallel", "patch_model", "context_parallel"),
                ("patch dtype", "patch_model", "dtype"),
                ("patch config", "patch_model", "config"),
                ("Engine max_rows", "Engine(...)", "max_rows"),
                ("new_cache max_length", "new_cache", "max_length"),
                ("model.generate inputs", "model.generate", "inputs"),
                ("model.generate max_new_tokens", "model.generate", "max_new_tokens"),
                ("model.generate stopping_criteria", "model.generate", "stopping_criteria"),
                ("model.generate generation_config", "model.generate",
                 "model.generation_config")]:
            assert got[key] == DIFFERENT.format(call, named), f"rank {rank}: {key}"
        for key, problem in [("patch swapped mesh", "the mesh's ranks [[1, 0]] do not increase"),
                             ("patch one-rank mesh", "the mesh spans 1 ranks, not the whole "
                                                     "world of 2"),
                             ("patch context_parallel str", "context_parallel must be True or "
                                                            "False, got 'False'")]:
            assert problem in got[key], f"rank {rank}: {key}: {got[key]}"
        for key, problem in [
                ("patch page_size bad", "cannot patch the model:\n  - page_size 3 is not a "
                                        "multiple of P = 2"),
                ("Engine max_rows bad", "invalid engine: max_rows must be a positive int or "
                                        "None, got 0"),
                ("Engine pool does not fit", f"invalid engine: num_pages {PAGES} need "),
                ("model.generate pool does not fit", "num_pages 2 need "),
                ("generate num_pages bad", "num_pages must be a positive int, got 0"),
                ("patch no mesh", "cannot patch the model:\n  - context_parallel=True needs a "
                                  "mesh"),
                ("Engine.run string without tokenizer", "invalid prompts: prompt 0: a string "
                                                        "needs tokenizer="),
                ("generate eos float", "eos_token_id must be an int or a list of ints, got "
                                       "1.5"),
                ("Engine cast", "invalid engine: " + CAST),
                ("generate cast", CAST), ("model.generate cast", CAST),
                ("new_cache batch_size bad", "batch_size must be a positive int, got 0")]:
            assert got[key].startswith("rank 1: " + problem if rank == 0 else problem), (
                f"rank {rank}: {key}: {got[key]}")
        assert got["Engine pool does not fit"].endswith("the free memory holds at most 0 pages")
    for rank, per_mode in enumerate(ranks):  # found alike on every rank: said once, as by one
        assert per_mode["refusals"]["Engine max_rows bad on both"] == (
            "invalid engine: max_rows must be a positive int or None, got 0")
        assert per_mode["refusals"]["warnings"] == (["IgnoredSettingWarning"] if rank == 0
                                                    else [])
    assert ranks[0]["refusals"]["agreed"] == ranks[1]["refusals"]["agreed"] == \
        ranks[0]["refusals"]["model.generate streamer on rank 0"]
    assert len(ranks[0]["refusals"]["agreed"]) == 3 + NEW
    for key in ("model.generate streamer raising on rank 0",
                "model.generate streamer raising on rank 0, by position"):
        assert ranks[0]["refusals"][key] == "BrokenPipeError: [Errno 32] Broken pipe (in this test)"
        assert ranks[1]["refusals"][key] == str(ranks[0]["refusals"]["agreed"])


@pytest.mark.parametrize("mode", list(MESHES))
def test_each_rank_holds_half_the_kv_and_every_page_returns(ranks, single, mode):
    for per_mode in ranks:
        kv_bytes, free = per_mode[mode][4:]
        assert kv_bytes * 2 == single[4]
        assert free == PAGES
        assert per_mode["tp, no cp"][4] == single[4], "without CP each TP rank copies the head"
    assert single[5] == PAGES


@pytest.mark.parametrize("mode", list(MESHES))
def test_planning_ahead_keeps_tokens_and_lockstep(ranks, hf, mode):
    """Engine(overlap_planning=True) over two partners: the unpatched model's tokens, some steps
    launched ahead (fed rank 0's broadcast tokens without waiting for them on the host), and
    the same collectives on both ranks."""
    runs = [per_mode[f"{mode} overlap"] for per_mode in ranks]
    for tokens, ahead, _ in runs:
        assert tokens == hf and ahead > 0
    assert runs[0][2] and runs[0][2] == runs[1][2]


@pytest.mark.parametrize("mode", list(MESHES))
def test_model_generate_over_two_partners_equals_hf(ranks, hf, mode):
    expected = [list(t) for t in hf if t]
    for rank, per_mode in enumerate(ranks):
        assert per_mode[f"{mode} model.generate"] == expected, f"rank {rank}"


@pytest.mark.parametrize("mode", list(MESHES))
def test_a_conversation_continues_from_its_cache_over_two_partners(ranks, mode):
    """The second turn, its cache grown on every rank, gives the unpatched model's tokens for
    the whole conversation (which it computes from scratch)."""
    model = tiny_qwen3()
    ids = torch.tensor([PROMPTS[0]])
    seq = torch.cat([model.generate(ids, max_new_tokens=2, do_sample=False),
                     torch.tensor([list(range(20, 50))])], 1)
    want = model.generate(seq, max_new_tokens=NEW, do_sample=False)[0, seq.shape[1]:].tolist()
    for rank, per_mode in enumerate(ranks):
        assert per_mode[f"{mode} next turn"] == want, f"rank {rank}"


@pytest.mark.parametrize("mode", list(MESHES))
def test_memory_running_out_on_one_rank_raises_on_every_rank(ranks, mode):
    """Rank 1 alone runs out of memory allocating an engine's pools, model.generate's cache,
    and growing a cache for the next turn: rank 1 raises its error and rank 0 one naming rank 1
    (before, rank 0 went on into the step's collectives and waited for ever). The cache keeps
    what it held: the next turn, retried, gives the unpatched model's tokens."""
    got = [per_mode[f"{mode} out of memory"] for per_mode in ranks]
    own = "OutOfMemoryError: CUDA out of memory (rank 1 alone, in this test)"
    for call, what in (("engine", "allocating the engine's pools"),
                       ("generate", "allocating the generate cache"),
                       ("grow", "growing the generate cache to")):
        assert got[1][call] == own, call
        assert got[0][call].startswith(f"OutOfMemoryError: {what}"), (call, got[0][call])
        assert f"failed on rank 1, so it stops on every rank (rank 1: {own})" in got[0][call]
    model = tiny_qwen3()
    ids = torch.tensor([PROMPTS[0]])
    seq = torch.cat([model.generate(ids, max_new_tokens=2, do_sample=False),
                     torch.tensor([list(range(20, 50))])], 1)
    want = model.generate(seq, max_new_tokens=NEW, do_sample=False)[0, seq.shape[1]:].tolist()
    assert got[0]["retried next turn"] == got[1]["retried next turn"] == want


@pytest.mark.parametrize("mode", list(MESHES))
def test_a_capture_running_out_of_memory_on_one_rank_raises_on_every_rank(ranks, mode):
    """Before, rank 0 went on to warm up the next bucket, whose step's collectives waited for
    rank 1 for ever. Now both raise after the second bucket's capture, before its warm-up."""
    got = [per_mode[f"{mode} capture out of memory"] for per_mode in ranks]
    own = "OutOfMemoryError: CUDA out of memory (rank 1 alone, in this test)"
    assert got[1][0] == own
    assert got[0][0] == (f"OutOfMemoryError: capturing the CUDA graph of Bucket(rows=2, "
                         f"tokens=2, max_pages=4) failed on rank 1, so it stops on every "
                         f"rank (rank 1: {own})")
    assert got[0][1] == got[1][1] == [(4, 4, 4), (2, 2, 4)]  # largest first; not the third


def test_memory_running_out_on_one_rank_while_patching_raises_on_every_rank(ranks, hf):
    """Rank 0 finished patching and went on to its first collective, waiting there for ever;
    rank 1 was left half patched. Now both raise and put back what they changed: in SP mode
    both patch again and generate the unpatched tokens; over TP, where the weights were cut
    to shards, patching again is refused, naming why."""
    got = [per_rank["patch out of memory"] for per_rank in ranks]
    own = "OutOfMemoryError: CUDA out of memory (rank 1 alone, in this test)"
    for mode in MESHES:
        assert got[1][mode] == own, mode
        assert got[0][mode] == (f"OutOfMemoryError: patch_model failed on rank 1, so it stops "
                                f"on every rank (rank 1: {own})"), mode
    assert got[0]["sp again"] == got[1]["sp again"] == [tuple(t) for t in hf]
    assert got[0]["tp again"] == got[1]["tp again"] == (
        "cannot patch the model:\n  - a patch_model that failed had cut this model's weights "
        "to one of 2 TP ranks' shards: load the model again")


@pytest.mark.parametrize("mode", list(MESHES))
def test_the_default_pool_cap_is_the_same_on_every_rank(ranks, mode):
    """Rank 1 sees twice rank 0's free memory; both size the default pool by rank 0's."""
    caps = [per_mode[f"{mode} pool cap"] for per_mode in ranks]
    assert caps[0] == caps[1] > 0
