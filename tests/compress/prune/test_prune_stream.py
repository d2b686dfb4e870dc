"""Stream (residual / block-output channel) pruning, `prune.scope: stream / all`: the trace,
forward shapes, the zero-channel equivalence and its controls, save / reload, the
SD-2.1-size config on the meta device, and bad input."""
from __future__ import annotations

import copy

import pytest
import torch
from diffusers import UNet2DConditionModel

from pocketdiff.compress.prune import graph as pg
from pocketdiff.compress.prune import stream as ps
from pocketdiff.compress.prune.verb import Config, PruneSettings, TargetConfig, load_pruned_unet, plan_shapes, prune_unet
from pocketdiff.compress.prune.importance import IMPORTANCE, score_stream
from pocketdiff.compress.prune.model import PrunedUNet2DConditionModel, build_pruned_unet, shape_spec
from pocketdiff.config import load_config
from pocketdiff.errors import ConfigError, PocketdiffError
from pocketdiff.models import unet_config


def _run(model, inputs):
    x, t, e = inputs
    with torch.no_grad():
        return model(x, t, encoder_hidden_states=e).sample


def _n(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------ the trace


def test_trace_of_tiny_unet(unet):
    graph = ps.trace_streams(unet)
    by = graph.by_name()
    # conv_in + down level 0, the downsampler's output, down level 1 joined with the mid block, and
    # in the up path every ResNet output (+ its attention) and the upsampler: 8 streams
    assert len(by) == 8 and graph.fixed == {"stream@conv_out": "the UNet output"}
    s0 = by["stream@conv_in"]
    producers = {m.module for m in s0.members if m.role == "out"}
    assert producers == {"conv_in", "down_blocks.0.resnets.0.conv2", "down_blocks.0.attentions.0.proj_out"}
    # the level-0 skip feeds both up-block-1 ResNets, behind the up stream in the concatenation
    skip = {(m.module, m.role, m.offset) for m in s0.members if m.module.startswith("up_blocks.1.resnets")}
    assert ("up_blocks.1.resnets.0.conv1", "in", 64) in skip and ("up_blocks.1.resnets.1.norm1", "norm", 32) in skip
    assert ("up_blocks.1.resnets.0.conv_shortcut", "in", 64) in skip
    # the mid block joins the last down level; up_blocks.0.resnets.0 sees that stream twice (mid output + skip)
    mid = by["stream@down_blocks.1.resnets.0"]
    assert {"mid_block.resnets.1.conv2", "mid_block.attentions.0.proj_out"} <= {m.module for m in mid.members if m.role == "out"}
    assert sorted(m.offset for m in mid.members if m.module == "up_blocks.0.resnets.0.conv1") == [0, 64]
    # the last up stream ends in conv_norm_out / conv_out
    last = by["stream@up_blocks.1.resnets.1"]
    assert {("conv_norm_out", "norm"), ("conv_out", "in")} <= {(m.module, m.role) for m in last.members}
    # atoms never split any GroupNorm group: conv_in's stream (groups of 4) meets a norm over
    # cat[64, 32] with groups of 12, whose group 5 straddles both streams (channels 0-7 kept)
    assert [a.tolist() for a in s0.atoms] == [list(range(8, 32))]
    assert graph.block_outputs["mid_block"] == "stream@down_blocks.1.resnets.0"


def test_trace_with_linear_projection_and_sd21_shapes(sd21_meta_unet):
    u = sd21_meta_unet
    graph = ps.trace_streams(u)
    assert graph.fixed == {"stream@conv_out": "the UNet output"}
    by = graph.by_name()
    s = by["stream@down_blocks.1.resnets.0"]  # level 1 (640): Linear proj_in / proj_out
    assert ("down_blocks.1.attentions.0.proj_in", "in", 0) in {(m.module, m.role, m.offset) for m in s.members}
    assert isinstance(u.down_blocks[1].attentions[0].proj_in, torch.nn.Linear)
    # the third down level's downsampler output joins level 3 (identity ResNets) and the mid block
    deep = by["stream@down_blocks.2.downsamplers.0"]
    assert {"down_blocks.3.resnets.1.conv2", "mid_block.resnets.1.conv2"} <= {m.module for m in deep.members}


# ------------------------------------------------------------------------------ shapes, save, reload


@pytest.mark.parametrize("scope", ["stream", "all"])
def test_forward_shapes_after_stream_pruning(unet, inputs, scope):
    pruned, plan = prune_unet(unet, PruneSettings(ratio=0.3, scope=scope, importance="l1", round_to=4))
    assert isinstance(pruned, PrunedUNet2DConditionModel)
    out = _run(pruned, inputs)
    assert out.shape == (2, 4, 8, 8) and torch.isfinite(out).all()
    assert _n(pruned) < _n(unet)
    narrowed = [s for s in plan["streams"] if s["channels_after"] < s["channels_before"]]
    assert len(narrowed) >= 4
    for s in plan["streams"]:
        assert s["channels_after"] % 4 == 0 and s["channels_after"] >= s["min_channels"]
    assert bool(plan["groups"]) == (scope == "all")
    # every GroupNorm still divides its channels into whole groups of the original size
    for name, m in pruned.named_modules():
        if isinstance(m, torch.nn.GroupNorm):
            ref = dict(unet.named_modules())[name]
            assert m.num_channels // m.num_groups == ref.num_channels // ref.num_groups, name
    # the targeted fraction is near the ratio
    prof_b, prof_a = pg.layer_profile(unet), pg.layer_profile(pruned)
    tb = sum(prof_b[n].params for n in plan["targeted"])
    ta = sum(prof_a[n].params for n in plan["targeted"])
    assert 0.25 < 1 - ta / tb < 0.35
    # the block widths the diffusers blocks record follow the modules (Down/Upsample2D assert on them)
    assert pruned.down_blocks[0].downsamplers[0].channels == pruned.down_blocks[0].downsamplers[0].conv.in_channels


def test_stream_pruned_unet_saves_and_reloads(unet, inputs, tmp_path):
    pruned, _ = prune_unet(unet, PruneSettings(ratio=0.3, scope="all", importance="l2", round_to=4))
    pruned.save_pretrained(tmp_path / "unet")
    loaded = load_pruned_unet(tmp_path / "unet")
    assert isinstance(loaded, PrunedUNet2DConditionModel) and _n(loaded) == _n(pruned)
    torch.testing.assert_close(_run(loaded, inputs), _run(pruned, inputs), rtol=0, atol=1e-6)
    # a stream-pruned UNet loaded back can be traced and pruned again
    again, _ = prune_unet(loaded, PruneSettings(ratio=0.2, scope="stream", allocation="global", round_to=4))
    assert _n(again) < _n(loaded) and _run(again, inputs).shape == (2, 4, 8, 8)
    # through the pipeline hook too (stock StableDiffusionPipeline.from_pretrained)
    from diffusers import StableDiffusionPipeline

    from pocketdiff.models import ModelConfig, build_pipeline, save_pipeline

    pipe = build_pipeline(ModelConfig(arch="tiny"), captions=["a red circle", "a blue square"], resolution=32)
    pipe.unet = pruned
    folder = save_pipeline(pipe, tmp_path / "pipeline")
    stock = StableDiffusionPipeline.from_pretrained(str(folder), safety_checker=None, requires_safety_checker=False,
                                                    local_files_only=True)
    torch.testing.assert_close(_run(stock.unet, inputs), _run(pruned, inputs), rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------ zero-channel equivalence


def _zero_atoms(unet, which) -> dict[str, torch.Tensor]:
    """Make some whole atoms of every stream carry exactly nothing: their producers' output
    rows and biases, their consumers' input columns and every GroupNorm affine over them
    set to 0 (a channel that is 0 everywhere and read by nobody). `which(i, n)` picks atoms."""
    graph = ps.trace_streams(unet)
    mods = dict(unet.named_modules())
    zeroed = {}
    with torch.no_grad():
        for s in graph.streams:
            picked = [a for i, a in enumerate(s.atoms) if which(i, len(s.atoms))]
            if not picked:
                continue
            idx = torch.cat(picked)
            zeroed[s.name] = idx
            for m in s.members:
                mod = mods[m.module]
                j = idx + m.offset
                if m.role == "out":
                    mod.weight[j] = 0
                    if mod.bias is not None:
                        mod.bias[j] = 0
                elif m.role == "in":
                    mod.weight[:, j] = 0
                else:
                    mod.weight[j] = 0
                    mod.bias[j] = 0
    return zeroed


def _half(i, n):  # every other atom, and a stream's only atom
    return i % 2 == 0


def _zero_internal(unet, gids=(1, 6)):
    """Whole norm2 groups of every ResNet's internal channels carry nothing (conv1 filters and
    biases, time_emb_proj rows, norm2 affines), so scope all can be checked exactly too."""
    with torch.no_grad():
        for g in pg.find_internal_groups(unet):
            gs = g.group_size
            idx = torch.cat([torch.arange(k * gs, (k + 1) * gs) for k in gids])
            g.conv1.weight[idx] = 0
            g.conv1.bias[idx] = 0
            g.time_emb_proj.weight[idx] = 0
            g.time_emb_proj.bias[idx] = 0
            g.norm2.weight[idx] = 0
            g.norm2.bias[idx] = 0


@pytest.fixture(scope="module", params=["conv_projection", "linear_projection"])
def zeroed(request, make_tiny_unet):
    u = make_tiny_unet(seed=3, use_linear_projection=request.param == "linear_projection")
    _zero_internal(u)
    return u, _zero_atoms(u, _half)


def test_zeroed_stream_channels_score_lowest(zeroed):
    u, zero = zeroed
    graph = ps.trace_streams(u)
    for s in graph.streams:
        if s.name not in zero:
            continue
        sc = score_stream(IMPORTANCE["l1"], s, u, torch.Generator())
        assert float(sc[zero[s.name]].abs().max()) == 0.0
        live = torch.ones(s.channels, dtype=torch.bool)
        live[zero[s.name]] = False
        assert float(sc[live].min()) > 0


@pytest.mark.parametrize("scope", ["stream", "all"])
def test_pruning_zero_stream_channels_leaves_outputs_unchanged(zeroed, inputs, scope):
    u, zero = zeroed
    ref = _run(u, inputs)
    pruned, plan = prune_unet(u, PruneSettings(ratio=0.3, scope=scope, importance="l1", round_to=4))
    removed_any = 0
    for s in plan["streams"]:
        gone = sorted(set(range(s["channels_before"])) - set(s["keep"]))
        assert set(gone) <= set(zero.get(s["stream"], torch.tensor([])).tolist()), s["stream"]
        removed_any += bool(gone)
    assert removed_any >= 4 and _n(pruned) < _n(u)
    for g in plan["groups"]:  # scope all: internal channels from the zeroed norm2 groups only
        gs = g["channels_before"] // g["groupnorm_groups_before"]
        assert {k // gs for k in set(range(g["channels_before"])) - set(g["keep"])} <= {1, 6}, g["group"]
    assert any(g["channels_after"] < g["channels_before"] for g in plan["groups"]) == (scope == "all")
    torch.testing.assert_close(_run(pruned, inputs), ref, rtol=0, atol=1e-5)


def test_zero_stream_equivalence_also_with_taylor(zeroed, inputs):
    """Taylor over every producer, consumer and GroupNorm affine of a stream: |w * dL/dw| of
    exactly-zero parameters is zero, so it removes zeroed atoms only."""
    from diffusers import DDIMScheduler

    from pocketdiff.compress.prune.importance import accumulate_diffusion_gradients
    from pocketdiff.models import scheduler_config

    u, zero = zeroed
    x, t, e = inputs

    def grads(work, params):
        accumulate_diffusion_gradients(work, DDIMScheduler(**scheduler_config("epsilon")), [(x, e)], 2, params,
                                       torch.Generator().manual_seed(0))

    pruned, plan = prune_unet(u, PruneSettings(ratio=0.3, scope="stream", importance="taylor", round_to=4),
                              gradient_fn=grads)
    for s in plan["streams"]:
        gone = set(range(s["channels_before"])) - set(s["keep"])
        assert gone <= set(zero.get(s["stream"], torch.tensor([])).tolist()), s["stream"]
    torch.testing.assert_close(_run(pruned, inputs), _run(u, inputs), rtol=0, atol=1e-5)


def _zero_keeps(u, zero):
    graph = ps.trace_streams(u)
    keeps = {}
    for s in graph.streams:
        if s.name in zero:
            mask = torch.ones(s.channels, dtype=torch.bool)
            mask[zero[s.name]] = False
            keeps[s.name] = torch.nonzero(mask).reshape(-1)
    return graph, keeps


def test_removing_every_zeroed_atom_is_exact(zeroed, inputs):
    """All zeroed atoms of all streams at once (down, mid, up, skips, samplers, conv_in)."""
    u, zero = zeroed
    graph, keeps = _zero_keeps(u, zero)
    work = copy.deepcopy(u)
    ps.prune_streams(work, graph, keeps)
    assert _n(work) < 0.8 * _n(u)
    torch.testing.assert_close(_run(work, inputs), _run(u, inputs), rtol=0, atol=1e-5)


@pytest.mark.parametrize("broken", ["skip_segment_of_cat_conv1", "producer_rows", "norm_channels", "random_importance"])
def test_equivalence_check_can_fail(zeroed, inputs, broken):
    """Controls: the same surgery with one slice wrong (a skip concatenation's segment in an
    up-block conv1, one producer's rows, one GroupNorm's channels), or live channels removed
    (random importance), must change the output."""
    u, zero = zeroed
    ref = _run(u, inputs)
    if broken == "random_importance":
        pruned, _ = prune_unet(u, PruneSettings(ratio=0.3, scope="stream", importance="random", round_to=4),
                               generator=torch.Generator().manual_seed(5))
        assert (_run(pruned, inputs) - ref).abs().max() > 1e-3
        return
    graph, keeps = _zero_keeps(u, zero)
    idx = ps.module_indices(graph, keeps)
    if broken == "skip_segment_of_cat_conv1":
        name, role = "up_blocks.1.resnets.1.conv1", "in"  # cat[up stream (32), level-0 skip (32)]
        assert graph.layout[name][role] == ["stream@up_blocks.1.resnets.0", "stream@conv_in"]
    elif broken == "producer_rows":
        name, role = "down_blocks.1.resnets.0.conv2", "out"
    else:
        name, role = "mid_block.attentions.0.norm", "norm"
    k = idx[name][role]
    n = {"in": lambda m: m.in_channels, "out": lambda m: m.out_channels, "norm": lambda m: m.num_channels}[role](
        dict(u.named_modules())[name])
    if role == "norm":  # keep the same number of whole groups, but the wrong ones
        gs = dict(u.named_modules())[name].num_channels // dict(u.named_modules())[name].num_groups
        dropped = sorted(set(range(n)) - set(k.tolist()))
        swap_out, swap_in = k[:gs], torch.tensor(dropped[:gs])
        k = torch.sort(torch.cat([k[gs:], swap_in])).values
        assert not set(swap_out.tolist()) & set(k.tolist())
    else:  # the last kept channel (in the last segment) swapped for the last removed (dead) one
        dropped = sorted(set(range(n)) - set(k.tolist()))
        k = torch.sort(torch.cat([k[:-1], torch.tensor(dropped[-1:])])).values
    idx[name][role] = k
    work = copy.deepcopy(u)
    ps.apply_indices(work, idx)
    assert (_run(work, inputs) - ref).abs().max() > 1e-3


# ------------------------------------------------------------------------------ SD-2.1 size, shape only


def test_sd21_size_config_stream_prunes_on_meta(sd21_meta_unet, meta_output_shape, targeted_removed):
    unet = sd21_meta_unet
    settings = PruneSettings(ratio=0.3, scope="all", round_to=8)
    sel, keep = plan_shapes(unet, settings)
    assert any(s.name == "stream@up_blocks.3.resnets.2" for s in sel.streams)
    names = [g.name for g in sel.groups] + [s.name for s in sel.streams]
    channels = {g.name: g.channels for g in sel.groups} | {s.name: s.channels for s in sel.streams}
    scores = {n: torch.arange(channels[n], dtype=torch.float64) for n in names}
    pruned, plan = prune_unet(unet, settings, scores=scores)
    assert all(p.device.type == "meta" for p in pruned.parameters())
    assert meta_output_shape(pruned) == (1, 4, 96, 96)
    assert 0.28 < targeted_removed(unet, pruned, plan["targeted"]) < 0.32
    assert sum(s["channels_after"] < s["channels_before"] for s in plan["streams"]) >= 10
    assert _n(pruned) < 0.8 * _n(unet)
    for s in plan["streams"]:
        assert s["channels_after"] % 8 == 0
    spec = shape_spec(pruned)
    rebuilt = build_pruned_unet(dict(unet.config), spec)
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {k: v.shape for k, v in pruned.state_dict().items()}


# ------------------------------------------------------------------------------ config and bad input


def test_scope_default_is_internal_and_unchanged(unet, inputs):
    assert PruneSettings().scope == "internal"
    a, plan_a = prune_unet(unet, PruneSettings(ratio=0.3, round_to=4))
    assert "streams" not in plan_a
    for g in pg.find_internal_groups(a):  # block widths untouched
        assert g.conv1.in_channels == dict(unet.named_modules())[g.name].conv1.in_channels


@pytest.mark.parametrize("override,match", [
    ("prune.scope=blocks", "prune.scope"),
    ("prune.ratio=0.97", r"prune.ratio=0.97 would leave fewer channels than GroupNorm groups in stream@"),
])
def test_bad_stream_input_names_the_field(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(Config, None, ["model.arch=tiny", "prune.scope=stream", override])


def test_stream_scope_config_and_targets():
    cfg = load_config(Config, None, ["model.arch=tiny", "prune.scope=all", "prune.ratio=0.4"])
    assert cfg.prune.scope == "all"
    # conv_in only owns a stream: a valid target with scope stream, nothing prunable with internal
    with torch.device("meta"):
        u = UNet2DConditionModel(**unet_config("tiny", resolution=32, vae_factor=4))
    sel, keep = plan_shapes(u, PruneSettings(ratio=0.3, scope="stream", round_to=4,
                                             targets=TargetConfig(include=["conv_in", "down_blocks.*"])))
    assert "conv_in" in sel.targeted and "stream@conv_in" in {s.name for s in sel.streams}
    with pytest.raises(PocketdiffError, match="no prunable conv"):
        plan_shapes(u, PruneSettings(ratio=0.3, targets=TargetConfig(include=["conv_in"])))
