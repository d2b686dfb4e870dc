"""The VAE encoder in row bands (export/banded_encoder.py): the whole encoder's values, every tensor under the device
profile's max_tensor_mb. SD-size checks run on the meta device (shapes only: the real SD / SDXL VAE configs, no
weights, no conversion); the tiny teacher's banded encoder is converted and run fully on the GPU delegate."""
from __future__ import annotations

import json

import pytest
import torch
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

from pocketdiff.archs import vae_config
from pocketdiff.errors import ParityError, PocketdiffError
from pocketdiff.export.banded_encoder import BandedEncoderGraph, check_band_parity, encoder_graph, plan_bands, psnr_db
from pocketdiff.export.vae_encoder import VaeEncoderGraph

MB = 2**20


def _tiny_vae(groups: int = 16):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(32, 64, 64), down_block_types=("DownEncoderBlock2D",) * 3,
                        up_block_types=("UpDecoderBlock2D",) * 3, latent_channels=4, norm_num_groups=groups,
                        layers_per_block=2).eval()
    with torch.no_grad():  # trained-like norm affines (identity ones would hide a wrong channel -> group map)
        for m in vae.modules():
            if isinstance(m, torch.nn.GroupNorm):
                m.weight.normal_(1.0, 0.3)
                m.bias.normal_(0.0, 0.3)
    return vae


@pytest.mark.parametrize("levels,bands", [(1, 2), (2, 3), (3, 4), (3, 7)])
def test_bands_equal_the_whole_encoder(levels, bands):
    """Banded convs, downsamplers and group norms give the whole encoder's latents: fp32 rounding only (about 140 dB
    here; 100 dB leaves room for another CPU's summation order, and a per-band GroupNorm scores ~20 dB)."""
    vae = _tiny_vae()
    px = torch.rand(1, 3, 64, 48, generator=torch.Generator().manual_seed(1))
    graph = BandedEncoderGraph(vae, levels, bands).eval()
    assert check_band_parity(vae, graph, px, 100.0) > 100.0


def test_parity_gate_raises_under_its_threshold():
    """A banded graph whose norms use each band's own statistics (a plain tiling) misses the named bar."""
    vae = _tiny_vae()
    px = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    graph = BandedEncoderGraph(vae, 1, 4).eval()
    own = lambda norm, act, bands, fractions: [act(norm(b)) for b in bands]  # noqa: E731
    graph._norm_act = own
    with torch.no_grad():
        db = psnr_db(VaeEncoderGraph(vae)(px), graph(px))
    assert db < 60.0
    with pytest.raises(ParityError, match="parity.encoder_bands_psnr_db=60"):
        check_band_parity(vae, graph, px, 60.0)


class _Largest(TorchDispatchMode):
    """The largest tensor any op of a forward makes (elements) and which op."""

    def __init__(self):
        super().__init__()
        self.n, self.what = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.n:
                self.n, self.what = t.numel(), f"{func} {list(t.shape)}"
        return out


def _largest_mb(arch: str, res: int, budget):
    """The SD-size encoder graph (rewrites of configs/sd21/export.yaml) traced on the meta device at `res` px."""
    from diffusers import AutoencoderKL

    from pocketdiff.export.rewrites import RewriteConfig, apply_rewrites

    with torch.device("meta"):
        vae = AutoencoderKL(**vae_config(arch, res)).eval()
        graph, plan = encoder_graph(vae, res, res, budget)
        px = torch.empty(1, 3, res, res)
        apply_rewrites(graph, RewriteConfig(attention_budget_mb=64, conv_budget_mb=3.5, conv_budget_scope="input"),
                       sample_inputs=(px,), component="vae_encoder")
        with torch.no_grad(), _Largest() as seen:
            out = graph(px)
    assert list(out.shape) == [1, 4, res // 8, res // 8]
    return seen.n * 2 / MB, seen.what, plan


@pytest.mark.parametrize("arch,res", [("sd21", 512), ("sd21", 768), ("sdxl", 1024)])
def test_sd_size_encoder_fits_the_phone_profile(arch, res):
    """Every tensor of SD's (SDXL's) encoder graph at 512 / 768 (1024) px is <= 64 MB at fp16 once banded; the whole
    graph's padded full-resolution tensor is over (64.3 MB at 512 px); the config-time plan bounds what the trace saw."""
    whole_mb, what, plan = _largest_mb(arch, res, None)
    assert plan["levels"] == 0 and whole_mb > 64.0 and "constant_pad" in what
    banded_mb, what, plan = _largest_mb(arch, res, 64.0)
    assert plan["levels"] >= 1 and plan["bands"] >= 2
    assert banded_mb <= 64.0, what
    assert plan["largest"] * 2 / MB <= 64.0


def test_precheck_no_longer_refuses_sd_sizes_and_names_an_impossible_budget():
    from pocketdiff.export.device_profile import DeviceProfile
    from pocketdiff.export.rewrites import RewriteConfig
    from pocketdiff.export.verb import Config
    from pocketdiff.models import ModelConfig

    rw = RewriteConfig(conv_budget_mb=3.5, conv_budget_scope="input", attention_budget_mb=64)
    for arch, res in (("sd21", 512), ("sd21", 768), ("sdxl", 1024)):
        Config(model=ModelConfig(arch=arch), components=["vae_encoder"], tasks=["image_to_image"], resolution=res,
               rewrites=rw, device_profile=DeviceProfile("phone", enforce=True))
    with pytest.raises(PocketdiffError, match="^device_profile.max_tensor_mb: the VAE encoder at 768x768 px"):
        Config(model=ModelConfig(arch="sd21"), components=["vae_encoder"], tasks=["image_to_image"], resolution=768,
               rewrites=rw, device_profile=DeviceProfile("phone", max_tensor_mb=0.5, enforce=True))


def test_plan_refuses_in_one_line():
    with pytest.raises(PocketdiffError, match=r"^device_profile.max_tensor_mb: .* 768x768 px does not fit"):
        plan_bands([128, 256, 512, 512], 768, 768, 1000)


def test_tiny_banded_encoder_export_on_the_delegate(gpu_delegate, tmp_path):
    """The shapes teacher's encoder under a profile scaled to its size (max_tensor_mb 0.03: its 32 px level and its
    16 px level are both over whole): exported in bands, fully on the GPU delegate, golden parity met, the converted
    graph's largest tensor under the budget."""
    from pocketdiff.cli import main as cli_main

    cfg = {"seed": 0, "model": {"pretrained": "pocketdiff:shapes-teacher"}, "components": ["vae_encoder"],
           "tasks": ["image_to_image"], "weights": "fp16", "guidance": "cfg", "guidance_scale": 3.0, "steps": 4,
           "fp16_scan": {"enabled": False}, "resolution": 32,
           "rewrites": {"conv_budget_mb": 3.5, "conv_budget_scope": "input"},
           "device_profile": {"name": "phone", "max_tensor_mb": 0.03, "enforce": True}}
    (tmp_path / "export.yaml").write_text(yaml.safe_dump(cfg))
    assert cli_main(["export", "--config", str(tmp_path / "export.yaml"), "--output", str(tmp_path / "enc")]) == 0
    rep = json.loads((tmp_path / "enc" / "report.json").read_text())["components"]["vae_encoder"]
    bands = rep["details"]["bands"]
    assert bands["levels"] == 2 and bands["bands"] == 3 and bands["parity_psnr_db"] > 100.0
    assert rep["fully_accelerated"] is True
    assert rep["device_profile"]["largest_tensor_mb"] <= 0.03 and not rep["device_profile"]["over_budget"]
    assert set(rep["details"]["parity"]) == {"fp16", "fp32"}
    for m in rep["details"]["parity"].values():
        assert m["psnr_db"] >= 30.0


def test_single_head_attention_whose_chunks_do_not_pair_evenly_still_converts_without_fully_connected(tmp_path):
    """SD's encoder at 768 px: 9216 queries, a 16 MB map budget gives 11 chunks, and 9216 is no multiple of 22, so the
    chunks fell back to plain matmuls, which convert to a FULLY_CONNECTED over the keys (9 MB input, over the phone
    profile's fc_input_mb). The chunk count now goes up to the next one that pairs (12 here): same result, no FC.
    Small analog: 44 queries, 3 chunks by budget -> 11 pairs of 2 rows."""
    import copy

    from diffusers.models.attention_processor import Attention

    from pocketdiff.export.convert import to_tflite
    from pocketdiff.export.device_profile import graph_memory
    from pocketdiff.export.rewrites import RewriteConfig, SplitAttention, apply_rewrites

    torch.manual_seed(0)
    attn = Attention(query_dim=16, heads=1, dim_head=16, norm_num_groups=4, residual_connection=True, rescale_output_factor=1.0,
                     bias=True, upcast_softmax=True, _from_deprecated_attn_block=True).eval()
    x = torch.randn(1, 16, 4, 11)
    budget = 2 * 44 * 15  # 15 query rows of the 44 x 44 fp16 map: 3 chunks by budget
    mine = SplitAttention(attn, budget_bytes=budget, bytes_per=2).eval()
    torch.testing.assert_close(mine(x), attn(x), rtol=1e-4, atol=1e-5)
    assert mine.last_chunks == 11 and 44 % (2 * mine.last_chunks) == 0
    model = torch.nn.Sequential(copy.deepcopy(attn)).eval()
    apply_rewrites(model, RewriteConfig(attention_budget_mb=budget / 2**20, group_norm=False, clipped_gelu=False,
                                        time_embedding_outside=False))
    to_tflite(model, (x,), tmp_path / "attn.tflite")
    mem = graph_memory(tmp_path / "attn.tflite")
    assert mem["largest_fc_input"] == "" and mem["largest_fc_input_mb"] == 0
