"""Structured pruning: dependency groups, channel surgery, GroupNorm semantics, allocation,
the zero-channel equivalence, and the SD-2.1-size config on the meta device."""
from __future__ import annotations

import copy

import pytest
import torch

from pocketdiff.compress.prune import graph as pg
from pocketdiff.compress.prune.verb import PruneSettings, TargetConfig, plan_shapes, prune_unet
from pocketdiff.compress.prune.importance import (
    IMPORTANCE,
    ImportanceContext,
    accumulate_diffusion_gradients,
    group_parameters,
    resolve_importance,
    score_group,
)
from pocketdiff.compress.prune.model import PrunedUNet2DConditionModel, build_pruned_unet, shape_spec
from pocketdiff.errors import PocketdiffError


def _run(model, inputs):
    x, t, e = inputs
    with torch.no_grad():
        return model(x, t, encoder_hidden_states=e).sample


# ------------------------------------------------------------------------------ groups


def test_internal_groups_of_tiny_unet(unet):
    groups = pg.find_internal_groups(unet)
    names = [g.name for g in groups]
    # every ResnetBlock2D: 2 down + 2 mid + 4 up on the tiny config
    assert len(groups) == 8
    assert "up_blocks.0.resnets.0" in names and "mid_block.resnets.1" in names
    for g in groups:
        assert g.conv1.out_channels == g.conv2.in_channels == g.norm2.num_channels == g.time_emb_proj.out_features


@pytest.mark.parametrize("mode", ["whole_groups", "per_group"])
def test_shapes_after_pruning(unet, inputs, mode):
    settings = PruneSettings(ratio=0.4, importance="l1", groupnorm=mode, round_to=8)
    pruned, plan = prune_unet(unet, settings)
    assert isinstance(pruned, PrunedUNet2DConditionModel)
    out = _run(pruned, inputs)
    assert out.shape == (2, 4, 8, 8) and torch.isfinite(out).all()
    assert sum(p.numel() for p in pruned.parameters()) < sum(p.numel() for p in unet.parameters())
    for g_plan, g in zip(plan["groups"], pg.find_internal_groups(pruned)):
        n = g.channels
        assert g_plan["channels_after"] == n < g_plan["channels_before"]
        assert n % 8 == 0
        assert g.conv1.out_channels == g.conv2.in_channels == g.norm2.num_channels == g.time_emb_proj.out_features == n
        assert n % g.norm2.num_groups == 0
        if mode == "per_group":
            assert g.norm2.num_groups == g_plan["groupnorm_groups_before"]
            # every new group holds kept channels of the same old group, in order
            old_gs = g_plan["channels_before"] // g_plan["groupnorm_groups_before"]
            keep = torch.tensor(g_plan["keep"])
            membership = keep // old_gs
            assert torch.equal(membership, torch.arange(g.norm2.num_groups).repeat_interleave(n // g.norm2.num_groups))
        else:
            old_gs = g_plan["channels_before"] // g_plan["groupnorm_groups_before"]
            assert n // g.norm2.num_groups == old_gs  # group size unchanged, whole groups gone
    # the original model is untouched
    assert pg.find_internal_groups(unet)[0].channels == 32


def test_pruned_weights_are_the_kept_slices(unet):
    pruned, plan = prune_unet(unet, PruneSettings(ratio=0.5, importance="l2", groupnorm="per_group", round_to=8))
    src = dict(unet.named_modules())
    dst = dict(pruned.named_modules())
    for gp in plan["groups"]:
        keep = torch.tensor(gp["keep"])
        name = gp["group"]
        assert torch.equal(dst[f"{name}.conv1"].weight, src[f"{name}.conv1"].weight[keep])
        assert torch.equal(dst[f"{name}.conv1"].bias, src[f"{name}.conv1"].bias[keep])
        assert torch.equal(dst[f"{name}.conv2"].weight, src[f"{name}.conv2"].weight[:, keep])
        assert torch.equal(dst[f"{name}.conv2"].bias, src[f"{name}.conv2"].bias)
        assert torch.equal(dst[f"{name}.norm2"].weight, src[f"{name}.norm2"].weight[keep])
        assert torch.equal(dst[f"{name}.time_emb_proj"].weight, src[f"{name}.time_emb_proj"].weight[keep])
        # the kept channels are the highest-L2 ones inside each GroupNorm group
        scores = src[f"{name}.conv1"].weight.detach().pow(2).flatten(1).sum(1)
        G = gp["groupnorm_groups_before"]
        gs = gp["channels_before"] // G
        m = gp["channels_after"] // G
        for j in range(G):
            top = torch.topk(scores[j * gs:(j + 1) * gs], m).indices + j * gs
            assert set(top.tolist()) == set(keep[j * m:(j + 1) * m].tolist())


# ------------------------------------------------------------------------------ zero-channel equivalence


def _zero_groups(unet, zeroed: dict[str, list[int]]):
    """Make whole GroupNorm groups of some blocks' internal channels contribute exactly nothing:
    conv1 filters + biases, time_emb_proj rows and norm2 affines of those channels set to 0."""
    mods = dict(unet.named_modules())
    with torch.no_grad():
        for name, gids in zeroed.items():
            blk = mods[name]
            gs = blk.norm2.num_channels // blk.norm2.num_groups
            idx = torch.cat([torch.arange(g * gs, (g + 1) * gs) for g in gids])
            blk.conv1.weight[idx] = 0
            blk.conv1.bias[idx] = 0
            blk.time_emb_proj.weight[idx] = 0
            blk.time_emb_proj.bias[idx] = 0
            blk.norm2.weight[idx] = 0
            blk.norm2.bias[idx] = 0


ZEROED = {  # 2 of 8 groups in every block = 25 % of the internal channels
    "down_blocks.0.resnets.0": [1, 6], "down_blocks.1.resnets.0": [0, 3], "mid_block.resnets.0": [2, 7],
    "mid_block.resnets.1": [4, 5], "up_blocks.0.resnets.0": [0, 7], "up_blocks.0.resnets.1": [3, 4],
    "up_blocks.1.resnets.0": [5, 6], "up_blocks.1.resnets.1": [1, 2],
}


@pytest.fixture(scope="module")
def zeroed_unet(make_tiny_unet):
    u = make_tiny_unet(seed=3)
    _zero_groups(u, ZEROED)
    return u


def _settings(importance="l1", mode="whole_groups"):
    # 2 of 8 groups: ratio 0.25, group size 4 (32 ch) or 8 (64 ch); round_to 4 allows both
    return PruneSettings(ratio=0.25, importance=importance, groupnorm=mode, round_to=4)


def test_pruning_zero_channels_leaves_outputs_unchanged(zeroed_unet, inputs):
    ref = _run(zeroed_unet, inputs)
    pruned, plan = prune_unet(zeroed_unet, _settings("l1"))
    # exactly the zeroed channels went
    for gp in plan["groups"]:
        gs = gp["channels_before"] // gp["groupnorm_groups_before"]
        removed_groups = sorted(set(range(gp["groupnorm_groups_before"])) - {k // gs for k in gp["keep"]})
        assert removed_groups == ZEROED[gp["group"]], gp["group"]
    assert sum(p.numel() for p in pruned.parameters()) < sum(p.numel() for p in zeroed_unet.parameters())
    out = _run(pruned, inputs)
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-5)


def test_zero_channel_equivalence_also_with_taylor(zeroed_unet, inputs):
    """Taylor scores of parameters that are exactly zero are zero, so it removes the same groups."""
    ref = _run(zeroed_unet, inputs)
    x, t, e = inputs

    def grads(work, params):
        g = torch.Generator().manual_seed(0)
        sched = _scheduler()
        accumulate_diffusion_gradients(work, sched, [(x, e)], 2, params, g)

    pruned, _ = prune_unet(zeroed_unet, _settings("taylor"), gradient_fn=grads)
    torch.testing.assert_close(_run(pruned, inputs), ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("how", ["random_channels", "per_group_mode"])
def test_equivalence_check_can_fail(zeroed_unet, inputs, how):
    """Controls: removing live channels (random importance), or keeping every GroupNorm
    group but removing channels inside them (statistics change), must change the output."""
    ref = _run(zeroed_unet, inputs)
    settings = _settings("random") if how == "random_channels" else _settings("l1", "per_group")
    pruned, _ = prune_unet(zeroed_unet, settings, generator=torch.Generator().manual_seed(5))
    assert (_run(pruned, inputs) - ref).abs().max() > 1e-3


def test_groupnorm_whole_group_removal_is_exact_on_one_block():
    """Dropping whole groups keeps every surviving channel's GroupNorm statistics."""
    torch.manual_seed(0)
    gn = torch.nn.GroupNorm(4, 16)
    gn.weight.data.normal_()
    gn.bias.data.normal_()
    x = torch.randn(2, 16, 5, 5)
    keep = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11])
    small = torch.nn.GroupNorm(2, 8)
    small.weight.data, small.bias.data = gn.weight.data[keep], gn.bias.data[keep]
    torch.testing.assert_close(small(x[:, keep]), gn(x)[:, keep])


# ------------------------------------------------------------------------------ importance


def _scheduler():
    from diffusers import DDIMScheduler

    from pocketdiff.models import scheduler_config

    return DDIMScheduler(**scheduler_config("epsilon"))


def test_builtin_importances(unet):
    g = pg.find_internal_groups(unet)[2]
    gen = torch.Generator().manual_seed(0)
    for name in ("l1", "l2", "random"):
        s = score_group(IMPORTANCE[name], g, unet, gen)
        assert s.shape == (g.channels,) and torch.isfinite(s).all() and (s >= 0).all()
    torch.testing.assert_close(score_group(IMPORTANCE["l1"], g, unet, gen),
                               g.conv1.weight.detach().abs().sum((1, 2, 3)).double())


def test_taylor_importance_needs_and_uses_gradients(inputs, make_tiny_unet):
    u = make_tiny_unet(seed=4)
    g = pg.find_internal_groups(u)[0]
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(PocketdiffError, match="gradient"):
        score_group(IMPORTANCE["taylor"], g, u, gen)
    x, t, e = inputs
    info = accumulate_diffusion_gradients(u, _scheduler(), [(x, e), (x, e)], 4, group_parameters([g]), gen, (0.0, 0.5))
    assert info["samples"] == 4 and info["timesteps"] == [0, 500]
    assert u.conv_in.weight.grad is None  # only the group's parameters get gradients
    s = score_group(IMPORTANCE["taylor"], g, u, gen)
    assert s.shape == (g.channels,) and (s > 0).all()
    # by hand for one channel: sum |w * grad| over everything the channel owns
    c = 3
    parts = [g.conv1.weight[c], g.conv1.bias[c], g.conv2.weight[:, c], g.norm2.weight[c], g.norm2.bias[c],
             g.time_emb_proj.weight[c], g.time_emb_proj.bias[c]]
    grads = [g.conv1.weight.grad[c], g.conv1.bias.grad[c], g.conv2.weight.grad[:, c], g.norm2.weight.grad[c],
             g.norm2.bias.grad[c], g.time_emb_proj.weight.grad[c], g.time_emb_proj.bias.grad[c]]
    want = sum(float((p.detach() * q).abs().sum()) for p, q in zip(parts, grads))
    assert s[c].item() == pytest.approx(want, rel=1e-4)


def custom_importance(conv, context: ImportanceContext):  # used through "module:function"
    return torch.arange(conv.out_channels, dtype=torch.float32)


def test_custom_importance_by_path(unet):
    fn = resolve_importance("test_prune_graph:custom_importance")
    pruned, plan = prune_unet(unet, PruneSettings(ratio=0.25, importance="test_prune_graph:custom_importance",
                                                  groupnorm="whole_groups", round_to=4))
    assert fn is custom_importance
    for gp in plan["groups"]:  # increasing scores: the first groups go
        assert gp["keep"] == list(range(gp["channels_before"] - gp["channels_after"], gp["channels_before"]))
    with pytest.raises(PocketdiffError, match="importance"):
        resolve_importance("nope")
    with pytest.raises(PocketdiffError, match="cannot import"):
        resolve_importance("no_such_module_xyz:f")


def test_bad_importance_output_is_refused(unet):
    g = pg.find_internal_groups(unet)[0]
    with pytest.raises(PocketdiffError, match="scores"):
        score_group(lambda conv, ctx: torch.ones(3), g, unet, torch.Generator())
    with pytest.raises(PocketdiffError, match="non-finite"):
        score_group(lambda conv, ctx: torch.full((conv.out_channels,), float("nan")), g, unet, torch.Generator())


# ------------------------------------------------------------------------------ targets and allocation


def test_target_selection_by_size_and_activation(unet):
    prof = pg.layer_profile(unet)
    # weight threshold: only convs with >= 30k weights (64-channel 3x3 and larger)
    sel = pg.select_targets(unet, prof, min_weight_params=30_000)
    assert sel.targeted and all(prof[n].weight_params >= 30_000 for n in sel.targeted)
    assert "down_blocks.0.resnets.0.conv1" not in sel.targeted  # 32x32x3x3 = 9216
    # activation threshold: outputs of >= 32*8*8 elements (the full-resolution level)
    sel = pg.select_targets(unet, prof, min_activation=32 * 8 * 8)
    assert "down_blocks.0.resnets.0.conv1" in sel.targeted and "mid_block.resnets.0.conv1" not in sel.targeted
    sel = pg.select_targets(unet, prof, include=["up_blocks.*"], exclude=["*conv2"])
    assert all(n.startswith("up_blocks") and n.endswith("conv1") for n in sel.targeted)
    assert "up_blocks.0.resnets.0.conv_shortcut" in sel.unprunable
    with pytest.raises(PocketdiffError, match="matches no Conv2d"):
        pg.select_targets(unet, prof, include=["decoder.*"])
    with pytest.raises(PocketdiffError, match="no prunable conv"):
        pg.select_targets(unet, prof, include=["conv_in"])
    with pytest.raises(PocketdiffError, match="no prunable conv"):
        pg.select_targets(unet, prof, min_weight_params=10**9)


def test_uniform_allocation_hits_the_ratio_and_refuses_too_much():
    budgets = [pg.GroupBudget("a", 32, 8, 100.0), pg.GroupBudget("b", 64, 8, 300.0), pg.GroupBudget("c", 64, 8, 50.0)]
    keep = pg.allocate(budgets, 0.3, "whole_groups", 4, "uniform")
    total = sum(b.cost * b.channels for b in budgets)
    removed = sum(b.cost * (b.channels - keep[b.name]) for b in budgets)
    assert abs(removed / total - 0.3) < 0.05
    assert all(keep[b.name] % 4 == 0 and keep[b.name] >= 8 for b in budgets)
    with pytest.raises(PocketdiffError, match="fewer than its 8 GroupNorm groups"):
        pg.allocate(budgets, 0.9, "whole_groups", 4, "uniform")


def test_global_allocation_prefers_unimportant_groups():
    s_low = torch.cat([torch.full((16,), 0.1), torch.full((16,), 1.0)])  # half the channels barely matter
    s_flat = torch.ones(32)
    budgets = [pg.GroupBudget("low", 32, 8, 10.0, s_low), pg.GroupBudget("flat", 32, 8, 10.0, s_flat)]
    keep = pg.allocate(budgets, 0.25, "whole_groups", 4, "global", max_layer_ratio=0.9)
    assert keep == {"low": 16, "flat": 32}
    with pytest.raises(PocketdiffError, match="cannot be reached"):
        pg.allocate(budgets, 0.8, "whole_groups", 4, "global", max_layer_ratio=0.5)


def test_surgery_refuses_inconsistent_indices(unet):
    u = copy.deepcopy(unet)
    g = pg.find_internal_groups(u)[0]  # 32 channels, 8 groups of 4
    with pytest.raises(PocketdiffError, match="whole GroupNorm groups"):
        pg.prune_internal(g, torch.tensor([0, 1, 2, 5]), "whole_groups")
    with pytest.raises(PocketdiffError, match="same number of channels"):
        pg.prune_internal(g, torch.tensor([0, 1, 4, 8, 12, 16, 20, 24, 28]), "per_group")
    with pytest.raises(PocketdiffError, match="sorted"):
        pg.prune_internal(g, torch.tensor([4, 0, 1, 2]), "whole_groups")


# ------------------------------------------------------------------------------ SD-2.1 size, shape only


def test_sd21_size_config_builds_and_prunes_on_meta(sd21_meta_unet, meta_output_shape, targeted_removed):
    unet = sd21_meta_unet
    settings = PruneSettings(ratio=0.3, groupnorm="whole_groups", round_to=8,
                             targets=TargetConfig(min_weight_params=5_000_000))
    sel, keep = plan_shapes(unet, settings)
    assert "up_blocks.2.resnets.0.conv1" in sel.targeted  # the 3x3 conv over 1920 inputs
    assert unet.up_blocks[2].resnets[0].conv1.in_channels == 1920
    scores = {g.name: torch.arange(g.channels, dtype=torch.float64) for g in sel.groups}
    pruned, plan = prune_unet(unet, settings, scores=scores)
    assert all(p.device.type == "meta" for p in pruned.parameters())
    assert meta_output_shape(pruned) == (1, 4, 96, 96)
    assert 0.27 < targeted_removed(unet, pruned, plan["targeted"]) < 0.33
    for gp in plan["groups"]:
        assert gp["channels_after"] % 8 == 0 and gp["channels_after"] == keep[gp["group"]]
        assert gp["channels_after"] % (gp["channels_before"] // gp["groupnorm_groups_before"]) == 0
    # the spec rebuilds the same shapes from the stock config
    spec = shape_spec(pruned)
    rebuilt = build_pruned_unet(dict(unet.config), spec)
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {k: v.shape for k, v in pruned.state_dict().items()}
