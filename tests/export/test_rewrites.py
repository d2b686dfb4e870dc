"""Each graph rewrite is numerically equivalent to the module it replaces (PyTorch only)."""
from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pocketdiff.errors import ConfigError, PocketdiffError
from pocketdiff.export.components import UNetGraph, time_embedding_table
from pocketdiff.export.rewrites import (
    ClippedGEGLU,
    ClippedGELU,
    Conv1x1Linear,
    RankFourGroupNorm,
    RewriteConfig,
    SerializedConv2d,
    SplitAttention,
    apply_rewrites,
    attention_chunks,
    choose_conv_split,
    clipped_gelu,
)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_linear_as_1x1_conv_matches_linear():
    lin = nn.Linear(24, 40)
    conv = Conv1x1Linear(lin, "proj")
    for shape in [(3, 24), (2, 7, 24), (2, 3, 5, 24)]:
        x = torch.randn(*shape, generator=_gen())
        torch.testing.assert_close(conv(x), lin(x), rtol=1e-5, atol=1e-6)
    assert conv.conv.pd_source == ("proj", None, None)


@pytest.mark.parametrize("fp16_safe", [False, True])
@pytest.mark.parametrize("shape", [(2, 16, 5, 3), (2, 16, 11)])
def test_rank4_group_norm_matches_group_norm(fp16_safe, shape):
    gn = nn.GroupNorm(4, 16, eps=1e-5)
    with torch.no_grad():
        gn.weight.normal_(1.0, 0.2, generator=_gen(1))
        gn.bias.normal_(0.0, 0.2, generator=_gen(2))
    mine = RankFourGroupNorm(gn, fp16_safe=fp16_safe)
    x = torch.randn(*shape, generator=_gen()) * 3 + 1
    torch.testing.assert_close(mine(x), gn(x), rtol=1e-4, atol=1e-5)


def test_fp16_safe_group_norm_survives_values_whose_squares_overflow_fp16():
    gn = nn.GroupNorm(2, 8)
    x = torch.randn(1, 8, 4, 4, generator=_gen()) * 2000.0  # (x - mean)^2 ~ 4e6 > 65504
    ref = gn(x)
    safe = RankFourGroupNorm(gn, fp16_safe=True).half()
    plain = RankFourGroupNorm(gn, fp16_safe=False).half()
    out_safe = safe(x.half()).float()
    assert torch.isfinite(out_safe).all()
    assert F.cosine_similarity(out_safe.flatten(), ref.flatten(), dim=0) > 0.999
    out_plain = plain(x.half()).float()
    assert not torch.allclose(out_plain, ref, atol=1e-2)  # the unsafe form collapses in fp16


def test_clipped_gelu_equals_tanh_gelu_and_is_close_to_erf_gelu():
    x = torch.linspace(-30, 30, 2001)
    torch.testing.assert_close(clipped_gelu(x, 10.0), F.gelu(x, approximate="tanh"), rtol=1e-6, atol=1e-6)
    assert (clipped_gelu(x, 10.0) - F.gelu(x)).abs().max() < 1e-3
    # fp16: the unclipped tanh-GELU overflows x^3 for |x| > ~110, the clipped one stays finite
    big = torch.tensor([200.0, -200.0, 3.0], dtype=torch.float16)
    assert torch.isfinite(clipped_gelu(big, 10.0)).all()
    torch.testing.assert_close(clipped_gelu(big, 10.0).float(), F.gelu(big.float()), rtol=1e-3, atol=1e-2)
    # the module swapped in for GELU activations (and diffusers' GELU with its projection) against torch's tanh-GELU,
    # not against clipped_gelu, which is what it calls
    torch.testing.assert_close(ClippedGELU(10.0)(x), F.gelu(x, approximate="tanh"), rtol=1e-6, atol=1e-6)
    proj = nn.Linear(6, 4)
    xp = torch.randn(3, 6, generator=_gen()) * 20
    torch.testing.assert_close(ClippedGELU(10.0, proj=proj)(xp), F.gelu(proj(xp), approximate="tanh"), rtol=1e-5, atol=1e-5)


def test_clipped_geglu_matches_diffusers_geglu():
    from diffusers.models.activations import GEGLU

    g = GEGLU(16, 12)
    x = torch.randn(2, 5, 16, generator=_gen())
    ref = g(x)
    mine = ClippedGEGLU(g, 10.0)
    assert (mine(x) - ref).abs().max() < 2e-3  # erf vs tanh GELU
    x_big = x * 50
    mine_tanh = ClippedGEGLU(g, 1e9)  # no clip: plain tanh-GELU
    torch.testing.assert_close(mine(x_big), mine_tanh(x_big), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("k_in,k_out", [(4, 1), (1, 3), (2, 3)])
def test_serialized_conv_matches_conv(k_in, k_out):
    conv = nn.Conv2d(8, 12, 3, padding=1)
    ser = SerializedConv2d(conv, k_in, k_out, name="c")
    x = torch.randn(2, 8, 6, 6, generator=_gen())
    torch.testing.assert_close(ser(x), conv(x), rtol=1e-5, atol=1e-5)
    assert len(ser.pieces) == k_in * k_out
    rows = {p.pd_source[1] for p in ser.pieces}
    cols = {p.pd_source[2] for p in ser.pieces}
    assert len(rows) == k_out and len(cols) == k_in


def test_conv_split_choice_is_smallest_and_prefers_input_channels():
    # input 1920x32x32 (the paper's case) is above the budget, the output fits: split the input
    in_e, out_e = 1920 * 32 * 32, 640 * 32 * 32
    assert choose_conv_split(in_e, out_e, 1920, 640, budget_elems=out_e) == (3, 1)
    # everything fits: no split
    assert choose_conv_split(in_e, out_e, 1920, 640, budget_elems=in_e) == (1, 1)
    # output too large only: output split
    assert choose_conv_split(out_e, in_e, 640, 1920, budget_elems=out_e) == (1, 3)
    # both: smallest product
    k = choose_conv_split(in_e, in_e, 1920, 1920, budget_elems=in_e // 4)
    assert k[0] * k[1] >= 8 and in_e // k[0] <= in_e // 4 and in_e // k[1] <= in_e // 4
    # impossible
    assert choose_conv_split(10, 10, 1, 1, budget_elems=5) is None


def test_apply_rewrites_serializes_convs_over_the_budget():
    model = nn.Sequential(nn.Conv2d(16, 8, 3, padding=1), nn.SiLU(), nn.Conv2d(8, 8, 1))
    x = torch.randn(1, 16, 16, 16, generator=_gen())
    ref = model(x)
    cfg = dataclasses.replace(RewriteConfig.none(), conv_budget_mb=(8 * 16 * 16 * 2) / 2**20)  # fits 8 channels at fp16
    rep = apply_rewrites(model, cfg, sample_inputs=(x,))
    assert rep["serialized_convs"] == {"0": [2, 1]}
    assert isinstance(model[0], SerializedConv2d)
    torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)


def test_conv_budget_input_scope_splits_inputs_only():
    # 16 -> 64 channels at 16x16: the input (16 channels) is over a 4-channel budget, the output (64) far over;
    # the input scope splits the input into 4 and leaves the output whole (the phone profile's conv_input_mb)
    model = nn.Sequential(nn.Conv2d(16, 64, 3, padding=1), nn.SiLU(), nn.Conv2d(64, 64, 1))
    x = torch.randn(1, 16, 16, 16, generator=_gen())
    ref = model(x)
    budget = (4 * 16 * 16 * 2) / 2**20
    both = apply_rewrites(copy.deepcopy(model), dataclasses.replace(RewriteConfig.none(), conv_budget_mb=budget), sample_inputs=(x,))
    assert both["serialized_convs"]["0"][1] > 1  # the default scope bounds the output too
    rep = apply_rewrites(model, dataclasses.replace(RewriteConfig.none(), conv_budget_mb=budget, conv_budget_scope="input"), sample_inputs=(x,))
    assert rep["serialized_convs"] == {"0": [4, 1], "2": [16, 1]}
    assert all(p.in_channels == 4 for p in model[0].pieces) and model[0].k_out == 1
    torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="rewrites.conv_budget_scope"):
        RewriteConfig(conv_budget_scope="output")
    # one input channel over the budget: the error names the scope and the one-channel input size
    tight = dataclasses.replace(RewriteConfig.none(), conv_budget_mb=(16 * 16 * 2 / 2) / 2**20, conv_budget_scope="input")
    with pytest.raises(PocketdiffError, match=r"conv 0: .*conv_budget_scope input; the smallest reachable piece, one channel, is 0.000488 MB"):
        apply_rewrites(nn.Sequential(nn.Conv2d(16, 64, 3, padding=1)), tight, sample_inputs=(x,))


def _attention(**kw):
    from diffusers.models.attention_processor import Attention

    torch.manual_seed(0)
    return Attention(**kw).eval()


def test_split_attention_matches_self_and_cross_attention():
    attn = _attention(query_dim=32, cross_attention_dim=24, heads=4, dim_head=8)
    x = torch.randn(2, 20, 32, generator=_gen())
    ctx = torch.randn(2, 7, 24, generator=_gen(1))
    ref = attn(x, encoder_hidden_states=ctx)
    mine = SplitAttention(attn)
    torch.testing.assert_close(mine(x, encoder_hidden_states=ctx), ref, rtol=1e-4, atol=1e-5)
    self_attn = _attention(query_dim=32, heads=4, dim_head=8)
    torch.testing.assert_close(SplitAttention(self_attn)(x), self_attn(x), rtol=1e-4, atol=1e-5)


def test_split_attention_matches_vae_spatial_attention():
    attn = _attention(query_dim=16, heads=1, dim_head=16, norm_num_groups=4, residual_connection=True,
                      rescale_output_factor=1.0, bias=True, upcast_softmax=True, _from_deprecated_attn_block=True)
    x = torch.randn(1, 16, 6, 5, generator=_gen())
    torch.testing.assert_close(SplitAttention(attn)(x), attn(x), rtol=1e-4, atol=1e-5)


def test_single_head_attention_converts_without_fully_connected_ops(tmp_path):
    # the VAE's mid-block attention (one head, batch 1): a plain q @ k^T there converts to a FULLY_CONNECTED
    # with the keys as weights (4 MB input at 512 px, over the phone profile's fc_input_mb); query pairs keep
    # BATCH_MATMUL, chunked or not, with the same result
    from pocketdiff.export.convert import to_tflite
    from pocketdiff.export.device_profile import graph_memory

    attn = _attention(query_dim=16, heads=1, dim_head=16, norm_num_groups=4, residual_connection=True,
                      rescale_output_factor=1.0, bias=True, upcast_softmax=True, _from_deprecated_attn_block=True)
    x = torch.randn(1, 16, 8, 6, generator=_gen())
    ref = attn(x)
    for budget, chunks in ((None, 1), (2 * 48 * 12, 4)):  # 12 query rows of the 48 x 48 fp16 map per chunk
        mine = SplitAttention(attn, budget_bytes=budget, bytes_per=2).eval()
        torch.testing.assert_close(mine(x), ref, rtol=1e-4, atol=1e-5)
        assert mine.last_chunks == chunks
    model = nn.Sequential(copy.deepcopy(attn)).eval()
    apply_rewrites(model, dataclasses.replace(RewriteConfig.none(), attention=True, linear_to_conv=True))  # projections: 1x1 convs
    to_tflite(model, (x,), tmp_path / "attn.tflite")
    mem = graph_memory(tmp_path / "attn.tflite")
    assert mem["largest_fc_input"] == "" and mem["largest_fc_input_mb"] == 0


def test_query_chunking_keeps_the_attention_map_under_budget_and_the_result_equal():
    attn = _attention(query_dim=32, heads=2, dim_head=16)
    x = torch.randn(1, 64, 32, generator=_gen())
    ref = attn(x)
    budget = 1 * 2 * 64 * 2 * 10  # 10 query rows of a [1, 2, 64, 64] fp16 map
    n = attention_chunks(2, 64, 64, budget, 2)
    assert n == math.ceil(64 / 10)
    mine = SplitAttention(attn, budget_bytes=budget, bytes_per=2)
    torch.testing.assert_close(mine(x), ref, rtol=1e-4, atol=1e-5)
    assert mine.last_chunks == n
    rows = math.ceil(64 / n)
    assert 1 * 2 * rows * 64 * 2 <= budget


@pytest.fixture(scope="module")
def tiny_unet():
    from pocketdiff.models import perturb_norm_affines, unet_config
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(**unet_config("tiny", resolution=32, vae_factor=4)).eval()
    perturb_norm_affines(unet, 0)
    return unet


def test_time_embedding_outside_the_graph_gives_the_same_output(tiny_unet):
    x = torch.randn(2, 4, 8, 8, generator=_gen())
    c = torch.randn(2, 77, 64, generator=_gen(1))
    t = torch.tensor([801.0, 801.0])
    with torch.no_grad():
        ref = UNetGraph(tiny_unet)(x, t, c)
        table = time_embedding_table(tiny_unet, 1000)
        outside = UNetGraph(copy.deepcopy(tiny_unet), external_time_embedding=True)
        out = outside(x, torch.from_numpy(table[[801, 801]]), c)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_all_rewrites_on_a_unet_keep_its_output(tiny_unet):
    x = torch.randn(2, 4, 8, 8, generator=_gen())
    c = torch.randn(2, 77, 64, generator=_gen(1))
    t = torch.tensor([401.0, 401.0])
    graph = UNetGraph(copy.deepcopy(tiny_unet))
    with torch.no_grad():
        ref = graph(x, t, c)
        cfg = RewriteConfig(time_embedding_outside=False, attention_budget_mb=0.001, conv_budget_mb=0.012)
        rep = apply_rewrites(graph, cfg, sample_inputs=(x, t, c))
        out = graph(x, t, c)
    assert rep["attention"] > 0 and rep["group_norm"] > 0 and rep["linear_to_conv"] > 0 and rep["clipped_gelu"] > 0
    assert rep["serialized_convs"]
    assert not any(isinstance(m, (nn.Linear, nn.GroupNorm)) for m in graph.modules())
    assert F.cosine_similarity(out.flatten(), ref.flatten(), dim=0) > 0.99999
    assert (out - ref).abs().max() < 5e-3 * ref.abs().max()


def test_residual_rescaling_keeps_unet_and_decoder_outputs_and_shrinks_the_stream(tiny_unet):
    from diffusers import AutoencoderKL

    from pocketdiff.export.components import VaeDecoderGraph
    from pocketdiff.export.fp16scan import Fp16Scanner
    from pocketdiff.models import perturb_norm_affines, vae_config

    x = torch.randn(2, 4, 8, 8, generator=_gen())
    c = torch.randn(2, 77, 64, generator=_gen(1))
    t = torch.tensor([601.0, 601.0])
    cfg = dataclasses.replace(RewriteConfig.none(), residual_scale=0.125)

    def peak(graph, args, prefix):
        sc = Fp16Scanner(emulate=False, accumulation=False)
        sc.attach(graph, prefix)
        with torch.no_grad():
            out = graph(*args)
        sc.detach()
        writers = (".conv_in", ".conv2", ".proj_out")  # the layers that write the residual stream
        return out, max(v.get("max_abs", 0) for k, v in sc.stats.items() if k.endswith(writers))

    graph = UNetGraph(copy.deepcopy(tiny_unet))
    ref, peak_ref = peak(graph, (x, t, c), "g")
    rep = apply_rewrites(graph, cfg)
    out, peak_scaled = peak(graph, (x, t, c), "g")
    assert rep["residual_scale"]["writers"] > 5
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert peak_scaled == pytest.approx(peak_ref * 0.125, rel=1e-3)

    torch.manual_seed(0)
    vae = AutoencoderKL(**vae_config("tiny", 32)).eval()
    perturb_norm_affines(vae, 0)
    dec = VaeDecoderGraph(vae)
    z = torch.randn(1, 4, 8, 8, generator=_gen(2))
    with torch.no_grad():
        ref = dec(z)
        rep = apply_rewrites(dec, dataclasses.replace(RewriteConfig(), residual_scale=0.25))
        out = dec(z)
    assert rep["residual_scale"]["scale"] == 0.25 and rep["residual_scale"]["writers"] > 5  # the decoder was rescaled
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_residual_scale_must_be_a_power_of_two():

    with pytest.raises(ConfigError, match="residual_scale"):
        RewriteConfig(residual_scale=0.1)


def test_residual_scale_auto_needs_the_fp16_scan():
    from pocketdiff.export.verb import Config, ScanConfig

    with pytest.raises(ConfigError, match="rewrites.residual_scale_auto"):
        Config(rewrites=RewriteConfig(residual_scale_auto=True), fp16_scan=ScanConfig(enabled=False))
    Config(rewrites=RewriteConfig(residual_scale_auto=True))  # the scan is on by default


def test_enforced_phone_profile_needs_the_conv_budget_that_meets_it():
    from pocketdiff.export.device_profile import DeviceProfile
    from pocketdiff.export.verb import Config

    with pytest.raises(ConfigError, match=r"rewrites.conv_budget_mb.*device_profile.conv_input_mb=3.5.*got None"):
        Config(device_profile=DeviceProfile("phone", enforce=True))
    with pytest.raises(ConfigError, match=r"rewrites.conv_budget_mb.*got 8.0"):
        Config(device_profile=DeviceProfile("phone", enforce=True), rewrites=RewriteConfig(conv_budget_mb=8.0))
    Config(device_profile=DeviceProfile("phone", enforce=True), rewrites=RewriteConfig(conv_budget_mb=3.5, conv_budget_scope="input"))
    Config(device_profile=DeviceProfile("phone"))  # reported only: no budget needed


def test_conv_budget_no_split_can_meet_names_the_module_and_the_smallest_size():
    model = nn.Sequential(nn.Conv2d(16, 8, 3, padding=1))
    x = torch.randn(1, 16, 16, 16, generator=_gen())
    cfg = dataclasses.replace(RewriteConfig.none(), conv_budget_mb=(16 * 16 * 2 / 2) / 2**20)  # half a channel at fp16
    with pytest.raises(PocketdiffError, match=r"conv 0: .* smallest reachable piece, one channel, is 0.000488 MB"):
        apply_rewrites(model, cfg, sample_inputs=(x,))


def test_residual_rescaling_keeps_a_folded_norm_free_decoder():
    """A folded GroupNorm (ChannelAffine: fixed statistics) is not scale-invariant: the rescale divides
    its weight by s, so the one-pass decoder's output is unchanged (the SD configs scale by 1/8)."""
    from diffusers import AutoencoderKL

    from pocketdiff.export.components import VaeDecoderGraph
    from pocketdiff.models import perturb_norm_affines, vae_config
    from pocketdiff.normfree import ChannelAffine, calibrate_group_stats, fold_group_norms, up_path_norm_names

    torch.manual_seed(0)
    vae = AutoencoderKL(**vae_config("tiny", 32)).eval()
    perturb_norm_affines(vae, 0)
    names = up_path_norm_names(vae)
    fold_group_norms(vae, calibrate_group_stats(vae, [torch.randn(2, 4, 8, 8, generator=_gen(3))], names))
    assert all(isinstance(vae.get_submodule(n), ChannelAffine) for n in names)
    dec = VaeDecoderGraph(vae)
    z = torch.randn(1, 4, 8, 8, generator=_gen(2))
    before = {n: vae.get_submodule(n).weight.detach().clone() for n in names}
    with torch.no_grad():
        ref = dec(z)
        rep = apply_rewrites(dec, dataclasses.replace(RewriteConfig(), residual_scale=0.125))
        out = dec(z)
    assert rep["residual_scale"]["norms"] > 0
    divided = [n for n in names if not torch.equal(vae.get_submodule(n).weight, before[n])]
    assert divided, "no folded norm read the scaled stream"  # else the unchanged output would prove nothing
    for n in divided:
        torch.testing.assert_close(vae.get_submodule(n).weight * 0.125, before[n], rtol=0, atol=0)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
