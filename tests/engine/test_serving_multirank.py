"""Under torchrun, rank 0 decides what is submitted and aborted (issue 17): two gloo ranks in TP
mode (P = 2), where rank 1 submits nothing and never aborts, stream the same outputs as rank 0,
the unpatched model's tokens for the requests rank 0 submitted, and record identical partner
collectives (lockstep). Two requests with the same stop string stop on both ranks, the criterion
sent to rank 1 once. Rank 1's own submission (with a stop string) is ignored, and makes no
criterion there (one that rank 0 dropped raised a KeyError at rank 1's next, helper 62)."""

from __future__ import annotations

import pytest
import torch
from multirank import run_ranks

import torch_cp
from torch_cp.engine import serving
from torch_cp.tiny import tiny_qwen3, tiny_tokenizer

pytestmark = pytest.mark.slow  # spawns gloo ranks

PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29] * 3, [200, 3, 150, 7, 99], [42]]
NEW = 8


def _stop_text() -> tuple[str, int]:
    """A stop string the unpatched model's stream for PROMPTS[0] reaches, and where."""
    tok = tiny_tokenizer()
    with torch.no_grad():
        stream = tiny_qwen3().generate(torch.tensor([PROMPTS[0]]), max_new_tokens=NEW,
                                       do_sample=False)[0, len(PROMPTS[0]):].tolist()
    at = next(i for i, t in enumerate(stream) if i >= 2 and tok.decode([t]).isalnum())
    return tok.decode([stream[at]]), at


def _serve(rank: int, world: int) -> dict:
    criteria_received = []
    broadcast = serving.dist.broadcast_object_list

    def counting(box, src=0):
        broadcast(box, src=src)
        if isinstance(box[0], tuple):  # the step's decisions, with the criteria they name
            criteria_received.append(len(box[0][1]))
    serving.dist.broadcast_object_list = counting
    mesh = torch_cp.init_mesh(tp=world, device_type="cpu")
    model = torch_cp.patch_model(tiny_qwen3(), context_parallel=True, mesh=mesh, page_size=4)
    model.torch_cp.exchange.records = []
    e = torch_cp.Engine(model, num_pages=64, max_tokens_per_step=8, max_rows=4,
                        overlap_planning=True)
    # Only rank 0's submissions count: rank 1 submits nothing and still steps with rank 0.
    stop = dict(stop_strings=[_stop_text()[0]], tokenizer=tiny_tokenizer())
    ids = []
    if rank == 0:
        ids = [e.submit(p, NEW) for p in PROMPTS] + [e.submit(PROMPTS[0], NEW, **stop)]
    else:  # ignored: rank 0's submissions reach every rank
        e.submit(PROMPTS[1], NEW, stop_strings="never\x07", tokenizer=tiny_tokenizer())
    outputs = e.step()
    if rank == 0:
        e.submit(PROMPTS[0], NEW, **stop)
    outputs += e.step()
    if rank == 0:
        e.abort(ids[2])
    outputs += list(e.stream())
    free = (e.allocator.free_pages, e.allocator.num_pages)
    return dict(outputs=[(o.request_id, o.token_ids, o.finished, o.finish_reason)
                         for o in outputs], records=model.torch_cp.exchange.records, free=free,
                criteria_received=sum(criteria_received), criteria_kept=len(e._stop_strings))


def test_rank_0_decides_and_ranks_stay_in_lockstep():
    ranks = run_ranks(2, _serve)
    assert ranks[1]["outputs"] == ranks[0]["outputs"]
    assert ranks[1]["records"] == ranks[0]["records"] and ranks[0]["records"]
    model = tiny_qwen3()
    got = {}
    for rid, tokens, _, _ in ranks[0]["outputs"]:
        got.setdefault(rid, []).extend(tokens)
    with torch.no_grad():
        for rid in (0, 1):
            want = model.generate(torch.tensor([PROMPTS[rid]]), max_new_tokens=NEW,
                                  do_sample=False)[0, len(PROMPTS[rid]):].tolist()
            assert got[rid] == want
    assert "abort" in [r for i, _, _, r in ranks[0]["outputs"] if i == 2]
    at = _stop_text()[1]
    for rid in (3, 4):  # the stop string's requests, submitted in different steps
        assert got[rid] == got[0][:at + 1]
        assert [r for i, _, _, r in ranks[0]["outputs"] if i == rid][-1] == "stop"
    assert ranks[1]["criteria_received"] == 1, "the criterion crossed once, for both requests"
    assert ranks[1]["criteria_kept"] == ranks[0]["criteria_kept"] == 1
    assert all(r["free"][0] == r["free"][1] for r in ranks)
