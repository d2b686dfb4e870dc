"""A pruned UNet still converts and runs fully accelerated on the LiteRT GPU delegate.

Goes the way `pocketdiff export` takes a UNet to the phone: `export.components.UNetGraph`
with the time embedding computed outside the graph (`time_embedding_table`), the module
rewrites `export.rewrites.apply_rewrites(RewriteConfig())` (Linear -> 1x1 conv, rank-4
GroupNorm, clipped GELU, explicit attention), litert-torch through
`export.convert.to_tflite`, then `runtime.delegate.run_on_delegate`: the delegate is the
judge. Pruned blocks have per-block GroupNorm group counts (whole_groups mode), which the
rank-4 GroupNorm rewrite must handle. Skips with the reason when litert-torch or a Vulkan
adapter (lavapipe in CI) is missing; the export stage itself is part of pocketdiff and must import.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from diffusers import UNet2DConditionModel

from pocketdiff.compress.prune import PruneSettings, prune_unet
from pocketdiff.export.components import UNetGraph, time_embedding_table
from pocketdiff.export.convert import to_tflite
from pocketdiff.runtime.delegate import delegate_available, run_on_delegate
from pocketdiff.export.rewrites import RewriteConfig, apply_rewrites
from pocketdiff.models import perturb_norm_affines, unet_config


def _require_delegate() -> None:
    pytest.importorskip("litert_torch", reason="litert-torch is not installed (pip install -e .[export])")
    ok, why = delegate_available()
    if not ok:
        pytest.skip(f"LiteRT GPU delegate unavailable: {why}")


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float((a * b).sum() / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("scope", ["internal", "all"])
def test_pruned_unet_runs_fully_accelerated_on_gpu_delegate(tmp_path, scope):
    """scope all: block-output (stream) channels pruned too, so skip concatenations, samplers,
    attention proj_in / proj_out and conv_in / conv_out are narrower as well."""
    _require_delegate()
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**unet_config("tiny", resolution=32, vae_factor=4)).eval()
    perturb_norm_affines(unet, 0)  # identity affines become BROADCAST_TO, which the GPU delegate rejects
    pruned, plan = prune_unet(unet, PruneSettings(ratio=0.3, scope=scope, importance="l1", groupnorm="whole_groups", round_to=4))
    assert any(g["groupnorm_groups_after"] < g["groupnorm_groups_before"] for g in plan["groups"])
    if scope == "all":
        assert any(s["channels_after"] < s["channels_before"] for s in plan["streams"])

    g = torch.Generator().manual_seed(0)
    temb = torch.from_numpy(time_embedding_table(pruned, 1000)[[500]])
    inputs = (torch.randn(1, 4, 8, 8, generator=g), temb, torch.randn(1, 77, 64, generator=g))
    graph = UNetGraph(copy.deepcopy(pruned), external_time_embedding=True).eval()
    with torch.no_grad():
        ref = graph(*inputs).numpy()
        direct = pruned(inputs[0], torch.tensor([500]), encoder_hidden_states=inputs[2]).sample.numpy()
    np.testing.assert_allclose(ref, direct, atol=1e-5)
    rewritten = copy.deepcopy(graph)
    info = apply_rewrites(rewritten, RewriteConfig(), sample_inputs=inputs)
    assert info.get("group_norm", 0) > 0 and info.get("linear_to_conv", 0) > 0
    with torch.no_grad():
        assert _cos(rewritten(*inputs).numpy(), ref) > 0.9999

    path = tmp_path / "unet_pruned.tflite"
    to_tflite(rewritten, inputs, path)
    run = run_on_delegate(path, [x.numpy() for x in inputs], precisions=("fp32", "fp16"))
    assert run.compiled, run.error
    assert run.fully_accelerated, run.rejected_summary()
    assert _cos(run.outputs["fp32"][0].reshape(ref.shape), ref) > 0.9999
    assert _cos(run.outputs["fp16"][0].reshape(ref.shape), ref) > 0.999  # the delegate's default precision
