"""``--decode-kernel`` of the benchmarks: the kernel and the Triton tile it sets, and the specs it
refuses before anything runs."""

from __future__ import annotations

import pytest

from benchmarks.common import apply_decode_kernel, apply_inductor_settings, apply_kernel_settings
from torch_cp.attention import flashinfer_gqa

triton_decode = pytest.importorskip("torch_cp.attention.triton_decode")
TILE = ("BLOCK_N", "WARPS", "PROGRAMS_PER_SM", "STAGES", "ONE_TOKEN_TILE")


@pytest.fixture(autouse=True)
def restore(monkeypatch):
    monkeypatch.setattr(flashinfer_gqa, "DECODE_KERNEL", flashinfer_gqa.DECODE_KERNEL)
    for name in TILE:
        monkeypatch.setattr(triton_decode, name, getattr(triton_decode, name))


def test_a_tile_sets_the_triton_kernels_defaults():
    assert apply_decode_kernel("triton:32:4:1:3") == "triton:32:4:1:3"
    assert flashinfer_gqa.DECODE_KERNEL == "triton"
    assert [getattr(triton_decode, name) for name in TILE] == [32, 4, 1, 3, None]
    assert triton_decode.spare_items(tokens=32, kv_heads=4, sms=132) == 33
    assert triton_decode.tile_for(1) == triton_decode.tile_for(32)  # no one-token tile left


def test_auto_keeps_the_tiles():
    one_token = triton_decode.ONE_TOKEN_TILE
    assert apply_decode_kernel("auto") == "auto" == flashinfer_gqa.DECODE_KERNEL
    assert triton_decode.ONE_TOKEN_TILE == one_token


@pytest.mark.parametrize("default", ["flashinfer", "auto"])
def test_no_spec_leaves_torch_cps_default(default):
    flashinfer_gqa.DECODE_KERNEL = default  # restored by the fixture
    assert apply_decode_kernel(None) == default == flashinfer_gqa.DECODE_KERNEL


@pytest.mark.parametrize("spec", ["cuda", "flashinfer:64:4:1", "auto:64:4:1", "triton:48:4:1",
                                  "triton:64:4", "triton:64:4:1:2:9", "triton:x:4:1"])
def test_a_bad_spec_exits_before_setting_anything(spec):
    flashinfer_gqa.DECODE_KERNEL = "flashinfer"  # restored by the fixture
    with pytest.raises(SystemExit):
        apply_decode_kernel(spec)
    assert flashinfer_gqa.DECODE_KERNEL == "flashinfer"


def test_inductor_settings_reach_config_sections():
    import torch._inductor.config as inductor_config

    # config.patch restores them (pytest's monkeypatch would leave Inductor's config broken)
    with inductor_config.patch({"max_autotune": inductor_config.max_autotune,
                                "triton.cudagraphs": inductor_config.triton.cudagraphs}):
        assert apply_inductor_settings("max_autotune=True,triton.cudagraphs=True") == {
            "max_autotune": True, "triton.cudagraphs": True}
        assert inductor_config.max_autotune is True and inductor_config.triton.cudagraphs is True
        for bad in ("no_such_setting=1", "triton.no_such=1", "no_section.x=1"):
            with pytest.raises(SystemExit, match="no setting"):
                apply_inductor_settings(f"max_autotune=False,{bad}")
            assert inductor_config.max_autotune is True  # nothing set before the exit


def test_kernel_settings_reach_torch_cp_constants_only(monkeypatch):
    from torch_cp.attention import triton_decode
    from torch_cp.graphs import fused_router

    monkeypatch.setattr(fused_router, "ROUTE_WARPS", fused_router.ROUTE_WARPS)
    monkeypatch.setattr(triton_decode, "MERGE_WARPS", triton_decode.MERGE_WARPS)
    assert apply_kernel_settings("torch_cp.graphs.fused_router.ROUTE_WARPS=2,"
                                 "torch_cp.attention.triton_decode.MERGE_WARPS=8") == {
        "torch_cp.graphs.fused_router.ROUTE_WARPS": 2,
        "torch_cp.attention.triton_decode.MERGE_WARPS": 8}
    assert fused_router.ROUTE_WARPS == 2 and triton_decode.MERGE_WARPS == 8
    for bad in ("torch_cp.graphs.fused_router.NO_SUCH=1", "torch_cp.no_such_module.X=1",
                "torch_cp.graphs.fused_router.route=1", "os.SEEK_SET=1"):
        with pytest.raises(SystemExit, match="no setting"):
            apply_kernel_settings(f"torch_cp.graphs.fused_router.ROUTE_WARPS=4,{bad}")
        assert fused_router.ROUTE_WARPS == 2  # nothing set before the exit


def test_the_grouped_tiles_space():
    experts_tiles = pytest.importorskip("benchmarks.experts_tiles")
    space = experts_tiles.grouped_space("rows=32,64;stages=2")
    assert space == dict(experts_tiles.GROUPED_SPACE, rows=(32, 64), stages=(2,))
    with pytest.raises(ValueError, match="'row' is not one of"):
        experts_tiles.grouped_space("row=32")
