"""The real LiteRT GPU delegate judges every export: rejected ops are named with the torch
module they came from, parity thresholds fail by name, the rewrites make graphs pass."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from pocketdiff.errors import ParityError, PocketdiffError
from pocketdiff.runtime.delegate import parse_delegate_log, run_on_delegate
from pocketdiff.export.exporter import VerifyConfig, export_component
from pocketdiff.export.parity import ParityConfig
from pocketdiff.runtime.parity import Thresholds, metrics
from pocketdiff.export.rewrites import RewriteConfig
from pocketdiff.runtime.tflite_file import TfliteModel, check_tflite_file

LOG = """INFO: something
ERROR: Following operations are not supported by GPU delegate:
BROADCAST_TO: Operation is not supported.
DEQUANTIZE:
MUL: Tensor dimensions must be less than 5. __main__.M/torch.nn.modules.normalization.GroupNorm_norm1;5
3 operations will run on the GPU, and the remaining 7 operations will run on the CPU.
"""


def test_parse_delegate_log():
    rejected, split = parse_delegate_log(LOG)
    assert split == (3, 7)
    assert [r.op for r in rejected] == ["BROADCAST_TO", "DEQUANTIZE", "MUL"]
    assert rejected[0].reason == "Operation is not supported."
    assert rejected[2].reason == "Tensor dimensions must be less than 5."
    assert rejected[2].module == "norm1"


def test_parity_metrics_and_named_failure():
    ref = np.linspace(-1, 1, 100).astype(np.float32)
    m = metrics(ref, ref + 1e-4)
    assert m["finite"] and m["cosine"] > 0.99999 and m["psnr_db"] > 70
    bad = ref.copy()
    bad[3] = np.nan
    assert not metrics(ref, bad)["finite"]
    from pocketdiff.export.parity import enforce

    with pytest.raises(ParityError, match=r"unet: fp16 cosine .* < parity\.fp16\.cosine_min"):
        enforce("unet", "fp16", metrics(ref, -ref), Thresholds(0.999, 30.0))
    with pytest.raises(ParityError, match=r"vae_decoder: .*NaN/Inf"):
        enforce("vae_decoder", "fp16", metrics(ref, bad), Thresholds(0.999, 30.0))


class NormBlock(nn.Module):
    """conv -> GroupNorm with identity affine (what a fresh model has) -> SiLU -> Linear over channels."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 16, 3, padding=1)
        self.norm1 = nn.GroupNorm(4, 16)
        self.proj = nn.Linear(16, 8)

    def forward(self, x):
        h = torch.nn.functional.silu(self.norm1(self.conv(x)))
        return self.proj(h.permute(0, 2, 3, 1))


@pytest.fixture(scope="module")
def norm_block():
    torch.manual_seed(0)
    return NormBlock().eval(), {"x": torch.randn(1, 4, 8, 8)}


def _verify():
    return VerifyConfig(precisions=["fp16", "fp32"])


def test_identity_norm_affine_is_rejected_naming_op_reason_and_module(gpu_delegate, norm_block, tmp_path):
    block, inputs = norm_block
    with pytest.raises(PocketdiffError) as err:
        export_component("block", block, inputs, tmp_path / "b.tflite", RewriteConfig.none(), "fp32", _verify(), ParityConfig())
    msg = str(err.value)
    assert "not fully accelerated" in msg and "BROADCAST_TO" in msg and "norm1" in msg


def test_rewrites_make_it_fully_accelerated_with_parity(gpu_delegate, norm_block, tmp_path):
    block, inputs = norm_block
    rep = export_component("block", block, inputs, tmp_path / "b.tflite", RewriteConfig(), "fp16", _verify(), ParityConfig())
    assert rep["fully_accelerated"] is True
    assert "BROADCAST_TO" not in rep["ops"] and rep["max_rank"] <= 4
    assert rep["parity"]["fp16"]["cosine"] > 0.999 and rep["parity"]["fp32"]["cosine"] > 0.99999
    assert rep["fp16_tensors"] >= 2  # conv + 1x1-conv weights stored as fp16
    assert rep["delegate"]["driver"] == gpu_delegate
    # an impossible named threshold fails the export, naming component and metric
    strict = ParityConfig(fp16=Thresholds(cosine_min=1.0, psnr_min_db=500.0))
    with pytest.raises(ParityError, match=r"block: fp16 (cosine|PSNR)"):
        export_component("block", block, inputs, tmp_path / "c.tflite", RewriteConfig(), "fp16", _verify(), strict)


def test_rank5_and_broadcast_ops_are_named_by_the_delegate(gpu_delegate, tmp_path):
    from pocketdiff.export.convert import to_tflite

    class Bad(nn.Module):
        def forward(self, x):
            y = (x.reshape(1, 2, 2, 4, 4) * 2.0).sum(dim=2)
            return y.reshape(1, 2, 4, 4).sum(1, keepdim=True) + torch.broadcast_to(x[:, :1], x.shape)[:, :1]

    path = tmp_path / "bad.tflite"
    to_tflite(Bad(), (torch.randn(1, 4, 4, 4),), path)
    run = run_on_delegate(path, [np.zeros((1, 4, 4, 4), np.float32)], precisions=["fp16"])
    assert not run.fully_accelerated
    ops = {r.op: r.reason for r in run.rejected}
    assert "BROADCAST_TO" in ops
    assert any("less than 5" in reason for reason in ops.values())


def test_tflite_rewriting_round_trip_fp16_and_corruption(gpu_delegate, norm_block, tmp_path):
    block, inputs = norm_block
    export_component("block", block, inputs, tmp_path / "b32.tflite", RewriteConfig(), "fp32", _verify(), ParityConfig())
    m = TfliteModel(tmp_path / "b32.tflite")
    assert m.op_histogram().get("DEQUANTIZE", 0) == 0
    m.save(tmp_path / "ext.tflite", external=True)  # the >2 GB layout: weights after the flatbuffer
    ref = block(*inputs.values()).detach().numpy()
    run = run_on_delegate(tmp_path / "ext.tflite", {"x": inputs["x"].numpy()}, precisions=["fp32"])
    assert run.fully_accelerated and metrics(ref, run.outputs["fp32"][0])["cosine"] > 0.99999
    check_tflite_file(tmp_path / "ext.tflite")
    data = (tmp_path / "ext.tflite").read_bytes()
    (tmp_path / "trunc.tflite").write_bytes(data[: len(data) // 2])
    with pytest.raises(PocketdiffError, match="truncated"):
        check_tflite_file(tmp_path / "trunc.tflite")
    (tmp_path / "junk.tflite").write_bytes(b"\0" * 64)
    with pytest.raises(PocketdiffError, match="not a .tflite"):
        check_tflite_file(tmp_path / "junk.tflite")


def test_linear_to_conv_adds_no_transposes_to_a_transformer_block(tmp_path):
    from diffusers.models.attention import BasicTransformerBlock

    from pocketdiff.models import perturb_norm_affines

    torch.manual_seed(0)
    block = BasicTransformerBlock(16, 2, 8, cross_attention_dim=16).eval()
    perturb_norm_affines(block, 0)

    class T(nn.Module):
        def __init__(self, b):
            super().__init__()
            self.b = b

        def forward(self, x, c):
            return self.b(x, encoder_hidden_states=c)

    inputs = {"x": torch.randn(1, 12, 16), "c": torch.randn(1, 5, 16)}
    graph_only = VerifyConfig(delegate=False)  # a graph property; the delegate is exercised elsewhere
    raw = export_component("t", T(block), inputs, tmp_path / "raw.tflite", RewriteConfig.none(), "fp32", graph_only, ParityConfig())
    cfg = dataclasses.replace(RewriteConfig(), time_embedding_outside=False)
    rew = export_component("t", T(block), inputs, tmp_path / "rw.tflite", cfg, "fp32", graph_only, ParityConfig())
    assert raw["ops"].get("FULLY_CONNECTED", 0) >= 8
    assert rew["ops"].get("FULLY_CONNECTED", 0) == 0 and rew["ops"]["CONV_2D"] >= 8
    assert rew["transposes"] <= raw["transposes"]


@pytest.mark.parametrize("path", ["to_tflite", "export_component"])
def test_conversion_hides_torch_deprecations_a_user_cannot_act_on(path, tmp_path):
    """torch's pytree deprecation fires inside litert-torch's export (10 lines in the demo)."""
    import warnings

    from pocketdiff.export import exporter
    from pocketdiff.export.convert import to_tflite

    module = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.SiLU())
    x = torch.randn(1, 3, 8, 8)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if path == "to_tflite":
            to_tflite(module, (x,), tmp_path / "m.tflite")
        else:  # the export verb's converter call (named inputs)
            exporter._convert(module, {"x": x}, tmp_path / "m.tflite")
    assert (tmp_path / "m.tflite").stat().st_size > 0
    assert not [w for w in seen if "LeafSpec" in str(w.message)]
