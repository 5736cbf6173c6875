"""torch_cp.from_pretrained in one process: the whole model as transformers loads it, every
problem named before any weight is read, a parameter left unloaded named, and the reader that
pushes a rank's part of a fused parameter through the expert stacking and concatenation.

Checkpoints: tests/helpers/saved_checkpoints.py (the tiny Qwen3 and DeepSeek-V3 of
test_from_pretrained, which loads them sharded over gloo ranks).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from saved_checkpoints import save_checkpoints

import torch_cp


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return save_checkpoints(tmp_path_factory.mktemp("checkpoints"))


def shape_mesh(sp: int, tp: int):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(sp * tp).view(sp, tp), mesh_dim_names=("sp", "tp"),
                      _init_backend=False)


@pytest.fixture
def no_reads(monkeypatch):
    """Fail the test if from_pretrained reads any weight."""
    def read(*args, **kwargs):
        raise AssertionError("a weight was read")
    monkeypatch.setattr("torch_cp.hf.load.read_into", read)


@pytest.mark.parametrize("name, dtype", [("qwen3", torch.bfloat16), ("qwen3", None),
                                         ("deepseek_v3", torch.float16)])
def test_one_rank_loads_what_transformers_loads(checkpoints, name, dtype):
    """mesh=None: every parameter and persistent buffer as transformers loads it, bit for bit,
    in the dtype asked (None: the checkpoint's, float32; DeepSeek-V3's router stays float32 as
    transformers keeps it), tied embeddings still one tensor."""
    model = torch_cp.from_pretrained(checkpoints[name], dtype=dtype)
    want = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[name],
                                                             dtype=dtype or torch.float32)
    mine, ref = model.state_dict(), want.state_dict()
    assert mine.keys() == ref.keys()
    for key, tensor in ref.items():
        assert mine[key].dtype == tensor.dtype and torch.equal(mine[key], tensor), key
    assert model.dtype == (dtype or torch.float32) and not model.training
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (name == "qwen3")
    assert model.torch_cp.tp == 1


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3"])
def test_loaded_or_patched_under_inference_mode_the_weights_stay_writable(checkpoints, name):
    """transformers loads outside inference mode; torch_cp's loads and patches (fused and
    sharded weights) were inference tensors when called inside it, and a later
    ``load_state_dict`` outside it raised. Now neither the weights nor the buffers are, and the
    reloaded model gives the unpatched tokens."""
    want = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[name]).eval()
    unpatched = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[name]).eval()
    with torch.inference_mode():
        loaded = torch_cp.from_pretrained(checkpoints[name])
        patched = torch_cp.patch_model(unpatched)
    ids = torch.tensor([[5, 9, 2, 77, 31]])
    expected = want.generate(ids, max_new_tokens=4, do_sample=False)
    for model in (loaded, patched):
        tensors = dict(model.named_parameters()) | dict(model.named_buffers())
        assert not [n for n, t in tensors.items() if t.is_inference()]
        model.load_state_dict(want.state_dict(), strict=False)
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), expected)


@pytest.mark.parametrize("name, top, text", [
    ("qwen3", None, None), ("qwen3_5", None, "bfloat16"), ("qwen3_5", "float32", "bfloat16"),
    ("qwen3_5", "float32", None)])
def test_without_a_dtype_the_checkpoints_own_is_taken_as_transformers_takes_it(
        checkpoints, tmp_path, name, top, text):
    """A bf16 checkpoint whose config.json names its dtype nowhere, or (a multimodal one) in its
    text config, or only at its top level, or at its top level otherwise than in its text
    config: dtype None loads bf16, as transformers' default ("auto") does from the text
    config's dtype, else from the first floating tensor; a multimodal checkpoint's top-level
    dtype is not read (the text model is built from the text config alone)."""
    import json

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[name]) if \
        name == "qwen3" else transformers.AutoModelForImageTextToText.from_pretrained(
            checkpoints[name])
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("dtype")
    config.get("text_config", {}).pop("dtype", None)
    for where, dtype in ((config, top), (config.get("text_config"), text)):
        if dtype:
            where["dtype"] = dtype
    (tmp_path / "config.json").write_text(json.dumps(config))
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    got = torch_cp.from_pretrained(tmp_path, device="cpu")
    assert want.dtype == got.dtype == torch.bfloat16
    for key, tensor in want.state_dict().items():
        assert torch.equal(got.state_dict()[key], tensor), key


@pytest.mark.parametrize("first, last", [("shards", "one file"), ("one file", "shards")])
def test_a_folder_saved_again_loads_what_transformers_loads(checkpoints, tmp_path, first, last):
    """A folder saved again with another shard size holds both ``model.safetensors`` and the
    shards' index (``save_pretrained`` removes neither): transformers reads the single file,
    whichever was saved last; so does torch_cp (it read the index: it refused the folder
    naming the shards the single file replaced, or loaded the other weights)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["qwen3"])
    negated = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["qwen3"])
    with torch.no_grad():
        for p in negated.parameters():
            p.neg_()
    for saved, how in ((model, first), (negated, last)):
        saved.save_pretrained(tmp_path, **({"max_shard_size": "30KB"} if how == "shards" else {}))
    assert (tmp_path / "model.safetensors").is_file()
    assert (tmp_path / "model.safetensors.index.json").is_file()
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    got = torch_cp.from_pretrained(tmp_path, device="cpu")
    for key, tensor in want.state_dict().items():
        assert torch.equal(got.state_dict()[key], tensor), key


def test_every_problem_is_named_before_any_weight_is_read(checkpoints, one_rank_world,
                                                          no_reads):
    with pytest.raises(ValueError) as info:
        torch_cp.from_pretrained(checkpoints["qwen3"], mesh=shape_mesh(1, 3), mode="ring",
                                 backend="triton", page_size=0, dtype=torch.float64)
    for problem in ("mode must be one of auto, tp, sp, got 'ring'", "backend must be one of",
                    "page_size must be a positive int, got 0",
                    "dtype must be float32, bfloat16 or float16, got torch.float64",
                    "4 query heads do not split evenly over tp = 3"):
        assert problem in str(info.value)
    with pytest.raises(ValueError, match="SP mode would work on this mesh: mode='sp'"):
        torch_cp.from_pretrained(checkpoints["qwen3"], mesh=shape_mesh(2, 1), mode="tp",
                                 context_parallel=True)


def _rewrite(src: str, dst, change) -> str:
    """A copy of the one-file checkpoint ``src`` in ``dst`` with ``change(tensors)`` applied."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(f"{src}/model.safetensors")
    change(tensors)
    save_file(tensors, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return str(dst)


def test_keys_that_do_not_match_are_named(checkpoints, tmp_path, no_reads):
    def change(t):
        del t["model.norm.weight"]
        t["model.extra.weight"] = torch.zeros(3)
        # an older checkpoint's per-layer RoPE buffer: computed by the model, skipped
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
        t["model.layers.0.mlp.up_proj.weight"] = torch.zeros(64, 64)
    path = _rewrite(checkpoints["qwen3"], tmp_path / "ckpt", change)
    with pytest.raises(ValueError) as info:
        torch_cp.from_pretrained(path)
    for problem in ("missing from the checkpoint: model.norm.weight",
                    "unexpected checkpoint keys (not in the model): model.extra.weight",
                    "model.layers.0.mlp.up_proj.weight: the checkpoint holds shape [64, 64], "
                    "the model [128, 64]"):
        assert problem in str(info.value)
    assert "inv_freq" not in str(info.value)


def test_paths_without_a_checkpoint_are_named(checkpoints, tmp_path):
    with pytest.raises(ValueError, match="not a directory with a config.json"):
        torch_cp.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text((Path(checkpoints["qwen3"]) / "config.json").read_text())
    with pytest.raises(ValueError, match="holds no safetensors checkpoint"):
        torch_cp.from_pretrained(tmp_path)
    sharded = shutil.copytree(checkpoints["deepseek_v3"], tmp_path / "sharded")
    lost = sorted(sharded.glob("model-*.safetensors"))[1]
    lost.unlink()
    with pytest.raises(ValueError, match=f"names {lost.name}, which is not in"):
        torch_cp.from_pretrained(sharded)


def test_a_path_without_a_checkpoint_is_named_with_every_argument_problem(tmp_path):
    """The missing config.json alone was named (helper 116): patch_model's checks that need no
    model, and the dtype, are named beside it."""
    with pytest.raises(ValueError) as info:
        torch_cp.from_pretrained(tmp_path / "nowhere", mode="x", backend="y", page_size=0,
                                 dtype="int8", context_parallel="False", mesh="mesh")
    for problem in ("not a directory with a config.json", "dtype must be float32, bfloat16 or "
                    "float16, got torch.int8", "mode must be one of auto, tp, sp, got 'x'",
                    "page_size must be a positive int, got 0", "backend must be one of",
                    "context_parallel must be True or False, got 'False'",
                    "mesh must be a DeviceMesh"):
        assert problem in str(info.value)
    with pytest.raises(ValueError, match="context_parallel=True needs a mesh"):
        torch_cp.from_pretrained(tmp_path / "nowhere", context_parallel=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA unavailable is one of the cases")
def test_a_device_that_cannot_hold_the_weights_is_named_first(checkpoints, no_reads):
    """CUDA without CUDA failed in the allocator after the reads began, an unknown device in
    torch.device, meta after the load (helper 69): now named with the other problems."""
    for device, problem in [("cuda", "device cuda: CUDA is not available"),
                            ("bogus", "device 'bogus': Expected one of"),
                            ("meta", "device meta holds no weights")]:
        with pytest.raises(ValueError, match=re.escape(problem)):
            torch_cp.from_pretrained(checkpoints["qwen3"], device=device)


def test_a_device_named_with_an_index_is_the_device_the_weights_are_on(checkpoints):
    """``device="cpu:0"``: CPU tensors report "cpu"; the engine's check that the model was not
    moved after patching took them apart (helper 62)."""
    model = torch_cp.from_pretrained(checkpoints["qwen3"], device="cpu:0")
    assert torch_cp.Engine(model, num_pages=8).kv_bytes > 0


def test_files_that_are_not_safetensors_are_named_with_the_missing_ones(checkpoints, tmp_path,
                                                                         no_reads):
    """A shard cut in half (an interrupted copy) and another gone: both named in one
    ValueError, not safetensors' own error."""
    sharded = shutil.copytree(checkpoints["deepseek_v3"], tmp_path / "sharded")
    cut, lost = sorted(sharded.glob("model-*.safetensors"))[:2]
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    lost.unlink()
    with pytest.raises(ValueError) as info:
        torch_cp.from_pretrained(sharded)
    assert f"{cut.name} is not a readable safetensors file" in str(info.value)
    assert f"names {lost.name}, which is not in" in str(info.value)
    (sharded / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match="index.json is not a JSON object with a weight_map"):
        torch_cp.from_pretrained(sharded)


def test_experts_numbered_out_of_order_are_named(checkpoints, tmp_path, no_reads):
    """Expert 1's keys saved as expert 7: stacked in key order they would load into other
    slots (transformers' loader takes them so); named instead."""
    def change(t):
        for key in [k for k in t if ".layers.0.mlp.experts.1." in k]:
            t[key.replace(".experts.1.", ".experts.7.")] = t.pop(key)
    path = _rewrite(checkpoints["qwen3_next"], tmp_path / "ckpt", change)
    with pytest.raises(ValueError) as info:
        torch_cp.from_pretrained(path)
    assert ("model.layers.0.mlp.experts.down_proj: the checkpoint's mlp.experts.*.down_proj.weight "
            "keys are numbered 0, 2, 3, 7, not 0 to 3 (missing 1; past the end 7)"
            in str(info.value))


def test_an_empty_checkpoint_names_every_key_missing(checkpoints, tmp_path, no_reads):
    path = Path(_rewrite(checkpoints["qwen3"], tmp_path / "ckpt", lambda t: t.clear()))
    with pytest.raises(ValueError, match="missing from the checkpoint: model.embed_tokens.weight, "
                                         "model.layers.0.input_layernorm.weight"):
        torch_cp.from_pretrained(path)
    (path / "model.safetensors").unlink()
    (path / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    with pytest.raises(ValueError, match="missing from the checkpoint: model.embed_tokens.weight"):
        torch_cp.from_pretrained(path)


def test_two_keys_for_one_parameter_are_named(checkpoints, tmp_path, no_reads):
    """transformers maps ``norm.weight`` (no base-model prefix) to ``model.norm.weight`` too."""
    path = _rewrite(checkpoints["qwen3"], tmp_path / "ckpt", lambda t: t.__setitem__(
        "norm.weight", torch.zeros_like(t["model.norm.weight"])))
    with pytest.raises(ValueError, match="checkpoint keys model.norm.weight and norm.weight both "
                                         "load into model.norm.weight"):
        torch_cp.from_pretrained(path)


def test_a_config_that_cannot_be_read_is_named_with_the_other_problems(checkpoints, tmp_path,
                                                                      no_reads):
    import json

    path = Path(shutil.copytree(checkpoints["qwen3"], tmp_path / "ckpt"))
    config = json.loads((path / "config.json").read_text())
    for text, problem in ((json.dumps({**config, "model_type": "qwen99"}), "model type `qwen99`"),
                          ("{not json", "not a valid JSON file"),
                          (json.dumps({"model_type": "t5"}), "T5Config builds no causal LM")):
        (path / "config.json").write_text(text)
        with pytest.raises(ValueError) as info:
            torch_cp.from_pretrained(path, dtype=torch.float64)
        assert problem in str(info.value)
        assert "dtype must be float32, bfloat16 or float16" in str(info.value)


def test_a_generation_config_that_cannot_be_read_is_named_before_any_weight_is_read(
        checkpoints, tmp_path, no_reads):
    """It was read after every weight (on one rank only where only its copy was bad, the
    others then waiting in their first collective)."""
    path = Path(shutil.copytree(checkpoints["qwen3"], tmp_path / "ckpt"))
    (path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError) as info:
        torch_cp.from_pretrained(path, dtype=torch.float64)
    assert "generation_config.json: OSError" in str(info.value)
    assert "dtype must be float32, bfloat16 or float16" in str(info.value)


def test_tied_embeddings_saved_as_the_lm_head_load_as_transformers_loads_them(checkpoints,
                                                                             tmp_path):
    path = _rewrite(checkpoints["qwen3"], tmp_path / "ckpt", lambda t: t.__setitem__(
        "lm_head.weight", t.pop("model.embed_tokens.weight")))
    want = transformers.AutoModelForCausalLM.from_pretrained(path)
    got = torch_cp.from_pretrained(path, device="cpu")
    assert got.lm_head.weight is got.model.embed_tokens.weight
    for key, tensor in want.state_dict().items():
        assert torch.equal(got.state_dict()[key], tensor), key


@pytest.mark.parametrize("head", ["equal", "different"])
def test_tied_embeddings_saved_under_both_names_load_as_transformers_loads_them(
        checkpoints, tmp_path, head, caplog):
    """A config that ties the embeddings and a checkpoint holding both: transformers ties them
    when the two tensors are equal, and otherwise keeps them apart (with a warning)."""
    def both(tensors):
        embed = tensors["model.embed_tokens.weight"]
        tensors["lm_head.weight"] = embed.clone() if head == "equal" else torch.randn_like(embed)
    path = _rewrite(checkpoints["qwen3"], tmp_path / "ckpt", both)
    want = transformers.AutoModelForCausalLM.from_pretrained(path)
    got = torch_cp.from_pretrained(path, device="cpu")
    tied = head == "equal"
    assert (want.lm_head.weight is want.model.embed_tokens.weight) == tied  # the reference
    assert (got.lm_head.weight is got.model.embed_tokens.weight) == tied
    assert ("not tied" in caplog.text) == (not tied)
    for key, tensor in want.state_dict().items():
        assert torch.equal(got.state_dict()[key], tensor), key
    prompt = [3, 1, 4, 1, 5]
    want_tokens = want.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)
    got_tokens = torch_cp.generate(got, [prompt], 4, progress=False)[0].token_ids
    assert list(got_tokens) == want_tokens[0, len(prompt):].tolist()


def test_a_parameter_left_on_meta_is_named(checkpoints, tmp_path, monkeypatch):
    cls = transformers.Qwen3ForCausalLM
    monkeypatch.setattr(cls, "_keys_to_ignore_on_load_missing", [r"model\.norm\.weight"])
    path = _rewrite(checkpoints["qwen3"], tmp_path / "ckpt",
                    lambda t: t.pop("model.norm.weight"))
    with pytest.raises(RuntimeError, match="model.norm.weight is still on the meta device"):
        torch_cp.from_pretrained(path)


@pytest.mark.parametrize("dim, runs", [
    (None, None), (1, [(4, 6), (1, 4)]), (1, [(0, 6)]), (2, [(3, 5), (0, 2)]), (0, [(1, 2)]),
], ids=["whole", "cat-dim-out-of-order-across-parts", "cat-dim-all", "inner-dim", "stack-dim"])
def test_reads_follow_the_runs_through_stack_and_cat(tmp_path, dim, runs):
    """A fused parameter ``cat([stack(a0, a1), stack(b0, b1)], 1)`` read in parts equals the
    same parts of the fused tensor (runs crossing from a to b, in any order)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from torch_cp.hf.checkpoint import Cat, Leaf, Stack, read_into

    parts = {k: torch.randn(3, 5) for k in ("a0", "a1", "b0", "b1")}
    save_file(parts, tmp_path / "w.safetensors")
    leaf = {k: Leaf(k, "w.safetensors", (3, 5)) for k in parts}
    tree = Cat(1, (Stack(0, (leaf["a0"], leaf["a1"])), Stack(0, (leaf["b0"], leaf["b1"]))))
    full = torch.cat([torch.stack([parts["a0"], parts["a1"]]),
                      torch.stack([parts["b0"], parts["b1"]])], 1)
    assert tree.shape == full.shape
    want = full if dim is None else full.index_select(
        dim, torch.tensor([i for a, b in runs for i in range(a, b)]))
    out = torch.empty_like(want)
    with safe_open(tmp_path / "w.safetensors", framework="pt") as f:
        read_into(tree, out, dim, runs, lambda name: f)
    assert torch.equal(out, want)
