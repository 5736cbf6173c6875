"""The progress bar moves through a long prefill (read from the bar's own output), ends at its
total when requests stop early, shows on rank 0 only; warnings come, once per call and at the
caller's line, where top_k / top_p are ignored or a request runs past max_position_embeddings,
and never when the settings are used."""

import importlib.util
import io
import re
import warnings
from types import SimpleNamespace

import pytest
import torch
from tqdm import tqdm

import torch_cp
from torch_cp.engine import (
    Engine,
    EngineWarning,
    IgnoredSettingWarning,
    PositionLimitWarning,
    SamplingParams,
    feedback,
)
from torch_cp.tiny import tiny_qwen3

PROMPT = [(5 * i) % 300 + 1 for i in range(100)]


@pytest.fixture
def bar_output(monkeypatch):
    """What the progress bar writes: every refresh (no minimum interval), into a buffer."""
    out = io.StringIO()

    class Captured(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "file": out, "mininterval": 0, "miniters": 1})

    monkeypatch.setattr(feedback, "tqdm", Captured)
    return out


def frames(out: io.StringIO) -> list[tuple[str, int, int, str]]:
    """(description, n, total, postfix) of every frame the bar drew."""
    found = re.findall(r"(\w+): +\d+%\|[^|]*\| (\d+)/(\d+) \[[^\]]*?(prompt \d+/\d+, new \d+)?\]",
                       out.getvalue())
    return [(d, int(n), int(t), p) for d, n, t, p in found]


def test_the_bar_moves_through_a_long_prefill(model, bar_output):
    # 100 prompt tokens in chunks of 16, then 4 new tokens: total 104.
    engine = Engine(model, num_pages=8, page_size=16, max_tokens_per_step=16)
    assert engine.run([PROMPT], 4, progress=True)[0].ok
    drawn = frames(bar_output)
    counts = [n for _, n, _, _ in drawn]
    assert sorted(set(counts)) == [0, 16, 32, 48, 64, 80, 96, 101, 102, 103, 104], drawn
    assert {t for _, _, t, _ in drawn} == {104}
    assert ("prefill", 48, 104, "prompt 48/100, new 0") in drawn
    assert drawn[-1] == ("decode", 104, 104, "prompt 100/100, new 4")


def test_the_bar_ends_at_its_total_when_requests_stop_early(model, bar_output):
    plain = torch_cp.generate(model, [PROMPT], 8, progress=False)[0].token_ids
    eos = plain[2]
    results = torch_cp.generate(model, [PROMPT, [], PROMPT[:9]], 8, eos_token_id=eos,
                                max_tokens_per_step=32, progress=True)
    assert results[0].token_ids == plain[:plain.index(eos) + 1]
    assert results[1].finish_reason == "error"  # an empty prompt counts for nothing
    _, n, total, _ = frames(bar_output)[-1]
    assert n == total < 100 + 9 + 2 * 8


def test_no_bar_off_rank_0(model, bar_output, monkeypatch):
    monkeypatch.setattr(feedback, "rank0", lambda: False)
    torch_cp.generate(model, [PROMPT[:5]], 2, progress=True)
    assert bar_output.getvalue() == ""


def test_status_lines_go_to_stderr_on_rank_0(capsys, monkeypatch):
    feedback.status("capturing CUDA graphs of 9 step buckets")
    assert capsys.readouterr().err == "torch_cp: capturing CUDA graphs of 9 step buckets\n"
    feedback.status("hidden", show=False)
    monkeypatch.setattr(feedback, "rank0", lambda: False)
    feedback.status("hidden")
    assert capsys.readouterr().err == ""


def engine_warnings(record) -> list[warnings.WarningMessage]:
    return [w for w in record if issubclass(w.category, EngineWarning)]


@pytest.mark.parametrize("kwargs,said", [
    (dict(top_k=5), "top_k=5 is ignored at temperature 0"),
    (dict(top_p=0.9), "top_p=0.9 is ignored at temperature 0"),
    (dict(top_k=5, top_p=0.9), "top_k=5 and top_p=0.9 are ignored at temperature 0"),
])
def test_top_k_and_top_p_at_temperature_0_warn_once(model, kwargs, said):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        results = torch_cp.generate(model, [PROMPT[:5], PROMPT[:7]], 3, progress=False, **kwargs)
    assert [str(w.message) for w in engine_warnings(record)] == [
        f"{said} (greedy decoding takes the most likely token): pass temperature > 0 to sample "
        f"with {'them' if len(kwargs) == 2 else 'it'}, or leave "
        f"{'them' if len(kwargs) == 2 else 'it'} out"]
    assert engine_warnings(record)[0].filename == __file__  # the caller's line
    greedy = torch_cp.generate(model, [PROMPT[:5], PROMPT[:7]], 3, progress=False)
    assert [r.token_ids for r in results] == [r.token_ids for r in greedy]
    with pytest.warns(IgnoredSettingWarning, match="top_k=2 is ignored"):
        Engine(model, num_pages=4).run([PROMPT[:5]], 2, SamplingParams(top_k=2))


def test_no_warning_when_the_settings_are_used(model):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        torch_cp.generate(model, [PROMPT[:5]], 3, temperature=0.7, top_k=5, top_p=0.9,
                          progress=False)
        torch_cp.generate(model, [PROMPT[:5]], 3, progress=False)
        Engine(model, num_pages=4).run([PROMPT[:5]], 3, SamplingParams(temperature=1.0, top_k=3))
    assert engine_warnings(record) == []


def test_requests_past_max_position_embeddings_warn_and_still_run():
    model = torch_cp.patch_model(tiny_qwen3(max_position_embeddings=32))
    reference = tiny_qwen3(max_position_embeddings=32)
    prompts = [PROMPT[:24], PROMPT[:30], PROMPT[:20], PROMPT[:25]]  # + 8 new: 32, 38, 28, 33
    with pytest.warns(PositionLimitWarning) as record:
        results = torch_cp.generate(model, prompts, 8, progress=False)
    assert len(record) == 1 and record[0].filename == __file__
    assert ("2 request(s) need more positions (prompt + max_new_tokens) than the model's "
            "max_position_embeddings (32): request 1 (38), request 3 (33). They still run"
            ) in str(record[0].message)
    for p, r in zip(prompts, results):  # still the unpatched model's tokens
        expected = reference.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                                      attention_mask=torch.ones(1, len(p), dtype=int))
        assert r.finish_reason == "length" and list(r.token_ids) == expected[0, len(p):].tolist()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        torch_cp.generate(model, [PROMPT[:24]], 8, progress=False)  # exactly 32: no warning
    assert engine_warnings(record) == []


def test_a_warning_naming_its_requests_is_shown_each_time_and_kept_nowhere():
    """Each long request submitted warns with its own id, so Python's registry of warnings shown
    (the caller module's ``__warningregistry__``) kept one entry a request: a server's grew
    without end (helper 119). Shown each time as before, kept in no registry."""
    model = torch_cp.patch_model(tiny_qwen3(max_position_embeddings=32))
    engine = Engine(model, num_pages=64)
    globals().pop("__warningregistry__", None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("default")
        ids = [engine.submit(PROMPT[:30], 8) for _ in range(5)]
    assert [str(w.message).split(": ")[1].split(".")[0] for w in record] == [
        f"request {i} (38)" for i in ids]
    assert all(w.filename == __file__ for w in record)
    assert not any("positions" in str(key) for key in globals().get("__warningregistry__", {}))
    for rid in ids:
        engine.abort(rid)
    list(engine.stream())


def test_scaled_rope_counts_its_factor_times_the_original_positions():
    """A YaRN config keeps max_position_embeddings at the trained length (Qwen3 at 128k: 40960)
    while the model is meant for the factor times the original length."""
    yarn = dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=16,
                rope_theta=10000.0)
    model = torch_cp.patch_model(tiny_qwen3(max_position_embeddings=16, rope_parameters=yarn))
    assert feedback.max_positions(model) == 32
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        torch_cp.generate(model, [PROMPT[:24]], 8, progress=False)  # 32: within 2 x 16
    assert engine_warnings(record) == []
    with pytest.warns(PositionLimitWarning, match=r"positions with its scaled RoPE \(32\): "
                                                  r"request 0 \(33\)"):
        torch_cp.generate(model, [PROMPT[:25]], 8, progress=False)
    model.config.rope_parameters = dict(yarn, factor=1.0)
    assert feedback.max_positions(model) == 16
    for odd in (None, -1, 40960.0):  # no usable limit: nothing counted, every row captured
        config = SimpleNamespace(max_position_embeddings=odd, rope_parameters=yarn)
        assert feedback.max_positions(SimpleNamespace(config=config)) is None


def test_submit_warns_as_run_does_and_generate_stream_once_for_the_batch():
    """``submit`` gave neither warning (helper 94); ``generate(stream=True)`` warns once for
    its whole batch, as ``run`` does, not once more per request."""
    model = torch_cp.patch_model(tiny_qwen3(max_position_embeddings=32))
    engine = Engine(model, num_pages=16)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        engine.submit(PROMPT[:30], 8, SamplingParams(top_k=2))
        engine.submit(PROMPT[:5], 3)  # neither
    said = [(w.category, w.filename) for w in engine_warnings(record)]
    assert sorted(said, key=str) == sorted([(IgnoredSettingWarning, __file__),
                                            (PositionLimitWarning, __file__)], key=str)
    assert "request 0 (38)" in str(next(w.message for w in engine_warnings(record)
                                         if w.category is PositionLimitWarning))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in torch_cp.generate(model, [PROMPT[:30], PROMPT[:31]], 8, progress=False,
                                   stream=True, top_k=2):
            pass
    assert sorted(w.category.__name__ for w in engine_warnings(record)) == [
        "IgnoredSettingWarning", "PositionLimitWarning"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
                    reason="needs CUDA and FlashInfer")
def test_lines_while_graphs_are_captured_and_layers_compiled(capfd):
    model = tiny_qwen3(dtype=torch.bfloat16, hidden_size=256, head_dim=128).cuda()
    model = torch_cp.patch_model(model, backend="flashinfer")
    engine = Engine(model, num_pages=64, page_size=16, max_tokens_per_step=16, max_rows=2,
                    cuda_graphs=True, max_pages_per_row=8, compile=True, progress=True)
    err = capfd.readouterr().err
    assert ("torch_cp: capturing CUDA graphs of 2 step buckets, compiling the decoder layers "
            "first") in err
    assert re.search(r"torch_cp: captured in \d+\.\d s", err)
    for _ in range(2):  # 40 tokens in chunks of 16 fit no bucket: compiled again, said once
        assert engine.run([PROMPT[:40]], 4, progress=True)[0].ok
    err = capfd.readouterr().err
    assert err.count("torch_cp: compiling the decoder layers for steps outside the captured "
                     "buckets") == 1
    assert "prompt 40/40, new 4" in err
