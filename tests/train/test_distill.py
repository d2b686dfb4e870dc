"""Distillation math and bookkeeping: round plans, two-step DDIM targets by hand, guidance embedding, bad input."""
import math

import pytest
import torch

from pocketdiff.config import load_config
from pocketdiff.errors import ConfigError, PocketdiffError
from pocketdiff.train import distill
from pocketdiff.train.distill import Config, RoundSpec, completed_rounds, plan_rounds, round_schedule
from pocketdiff.train.distill_targets import (
    GuidedTeacher,
    guided_x_target,
    loss_weight,
    noisy_latents,
    round_plan,
    two_step_x_target,
    x_from_two_steps,
    x_space_loss,
)
from pocketdiff.train.guidance_embedding import add_guidance_embedding, is_w_conditioned, w_condition, w_embedding_fn


def _sched(spacing="trailing", prediction_type="epsilon"):
    from diffusers import DDIMScheduler

    from pocketdiff.models import scheduler_config

    return DDIMScheduler(**{**scheduler_config(prediction_type), "timestep_spacing": spacing})


# ------------------------------------------------------------------ round bookkeeping

def test_round_schedule_halves_down_to_the_final_count():
    assert round_schedule(64, 4) == [32, 16, 8, 4]
    assert round_schedule(8, 8) == []
    assert round_schedule(12, 3) == [6, 3]


@pytest.mark.parametrize("start,final", [(64, 3), (48, 4), (64, 5), (4, 8)])
def test_unreachable_final_count_is_a_config_error(start, final, tmp_path):
    with pytest.raises(ConfigError, match="progressive"):
        load_config(Config, None, [f"progressive.start_steps={start}", f"progressive.final_steps={final}"])


def test_plan_rounds_numbers_guided_stage_zero_and_teacher_grids():
    cfg = load_config(Config, None, ["progressive.start_steps=16", "progressive.final_steps=4", "guided.train.max_steps=7",
                                     "progressive.train.max_steps=5"])
    plan = plan_rounds(cfg)
    assert [(s.index, s.stage, s.steps, s.teacher_steps, s.max_steps) for s in plan] == [
        (0, "guided", 16, None, 7), (1, "progressive", 8, 16, 5), (2, "progressive", 4, 8, 5)]
    cfg = load_config(Config, None, ["progressive.start_steps=16", "progressive.final_steps=4", "guided.enabled=false",
                                     "progressive.round_max_steps=[3,9]"])
    assert [(s.index, s.steps, s.teacher_steps, s.max_steps) for s in plan_rounds(cfg)] == [(1, 8, 16, 3), (2, 4, 8, 9)]
    with pytest.raises(ConfigError, match="round_max_steps"):
        load_config(Config, None, ["progressive.start_steps=16", "progressive.final_steps=4", "progressive.round_max_steps=[3]"])


def test_completed_rounds_needs_the_committed_folder(tmp_path):
    plan = [RoundSpec(0, "guided", 8, None, 1), RoundSpec(1, "progressive", 4, 8, 1), RoundSpec(2, "progressive", 2, 4, 1)]
    assert completed_rounds(tmp_path, plan) == 0
    (tmp_path / "round-0").mkdir()
    (tmp_path / "round-0" / distill.DISTILL_META).write_text("{}")
    (tmp_path / ".round-1.tmp").mkdir()  # torn write: never counts
    (tmp_path / "round-2").mkdir()
    (tmp_path / "round-2" / distill.DISTILL_META).write_text("{}")  # a gap: round 1 missing
    assert completed_rounds(tmp_path, plan) == 1


def test_guidance_range_min_above_max_is_rejected():
    with pytest.raises(ConfigError, match=r"guidance.w_min.*w_min=5.0 > w_max=2.0"):
        load_config(Config, None, ["guidance.w_min=5", "guidance.w_max=2"])


def test_bad_input_fails_on_the_cli_before_any_training(tmp_path, capsys):
    from pocketdiff.cli import main

    code = main(["distill", "--output", str(tmp_path / "o"), "guidance.w_min=9", "guidance.w_max=1"])
    assert code == 2 and "w_min=9.0 > w_max=1.0" in capsys.readouterr().err
    code = main(["distill", "--output", str(tmp_path / "p"), "progressive.start_steps=64", "progressive.final_steps=6"])
    assert code == 2 and "cannot be reached" in capsys.readouterr().err
    assert not (tmp_path / "o" / "checkpoints").exists() and not (tmp_path / "p" / "checkpoints").exists()


# ------------------------------------------------------------------ round plans

def test_trailing_plan_nests_in_the_teacher_grid_and_matches_ddim_scheduler():
    s = _sched("trailing")
    plan = round_plan(s, 4, teacher_steps=8)
    assert plan.t.tolist() == [999, 749, 499, 249]
    assert plan.t_mid.tolist() == [874, 624, 374, 124]  # every midpoint is a teacher grid point
    s.set_timesteps(4)
    assert plan.t.tolist() == s.timesteps.tolist()
    ac = s.alphas_cumprod
    assert torch.allclose(plan.a_prev, torch.stack([ac[749], ac[499], ac[249], ac[0]]).float())  # final alpha = alphas_cumprod[0]
    assert torch.allclose(plan.a_mid, ac[plan.t_mid].float())


def test_leading_plan_uses_scheduler_jumps_even_when_grids_do_not_nest():
    s = _sched("leading")
    plan = round_plan(s, 8, teacher_steps=16)  # 1000 // 8 = 125 != 2 * (1000 // 16)
    assert plan.t.tolist() == [876, 751, 626, 501, 376, 251, 126, 1]
    for t, m, *_ in plan.rows():
        assert t - 125 < m < t or (t == 1 and m == 1)
    assert plan.t_mid[-1].item() == 1  # a one-timestep jump: the first teacher step is the identity


# ------------------------------------------------------------------ targets by hand

class ToyUNet(torch.nn.Module):
    """A 'UNet' whose output is an explicit function of (z, t, text): easy to compute by hand."""

    def __init__(self, w_dim=None):
        super().__init__()
        self.config = type("C", (), {"time_cond_proj_dim": w_dim})()
        self.p = torch.nn.Parameter(torch.tensor(0.3))

    def forward(self, z, t, encoder_hidden_states, timestep_cond=None, return_dict=False):
        text = encoder_hidden_states.float().mean(dim=(1, 2)).view(-1, 1, 1, 1)
        tt = t.float().view(-1, 1, 1, 1) / 1000
        out = self.p * z * (1 + tt) + text
        if timestep_cond is not None:
            out = out + timestep_cond.float()[:, :1].view(-1, 1, 1, 1)
        return (out,)


def _hand_ddim(z, eps_hat, a_t, a_prev):
    x0 = (z - math.sqrt(1 - a_t) * eps_hat) / math.sqrt(a_t)
    return math.sqrt(a_prev) * x0 + math.sqrt(1 - a_prev) * eps_hat


def test_two_step_target_equals_a_hand_computation():
    from diffusers import DDIMScheduler

    s = _sched("trailing", "epsilon")
    plan = round_plan(s, 4, teacher_steps=8)
    g = torch.Generator().manual_seed(0)
    B = 3
    z = torch.randn(B, 4, 2, 2, generator=g, dtype=torch.float64).float()
    cond, uncond = torch.randn(B, 5, 6, generator=g), torch.randn(1, 5, 6, generator=g)
    w = torch.tensor([1.0, 2.5, 7.0])
    k = torch.tensor([0, 2, 3])
    toy = ToyUNet()
    teacher = GuidedTeacher(toy, "epsilon")
    x_t = two_step_x_target(teacher, z, plan.t[k], plan.t_mid[k], plan.a_t[k], plan.a_mid[k], plan.a_prev[k], cond, uncond, w)

    ac = s.alphas_cumprod.double()
    for i in range(B):
        t, mid = int(plan.t[k[i]]), int(plan.t_mid[k[i]])
        a_t, a_m = float(ac[t]), float(ac[mid])
        a_p = float(ac[t - 250]) if t - 250 >= 0 else float(ac[0])
        zi = z[i : i + 1].double()

        def guided(x, tt):
            p = 0.3
            c = p * x * (1 + tt / 1000) + cond[i].double().mean()
            u = p * x * (1 + tt / 1000) + uncond[0].double().mean()
            return u + float(w[i]) * (c - u)

        z_mid = _hand_ddim(zi, guided(zi, t), a_t, a_m)
        z_prev = _hand_ddim(z_mid, guided(z_mid, mid), a_m, a_p)
        # the x whose one DDIM step t -> prev lands on z_prev
        r = math.sqrt(1 - a_p) / math.sqrt(1 - a_t)
        x_hand = (z_prev - r * zi) / (math.sqrt(a_p) - r * math.sqrt(a_t))
        assert torch.allclose(x_t[i : i + 1].double(), x_hand, rtol=1e-4, atol=1e-4), i
        # and diffusers' own DDIMScheduler at 8 steps takes the same two teacher steps
        d = DDIMScheduler.from_config(s.config)
        d.set_timesteps(8)
        assert mid in d.timesteps.tolist() and t in d.timesteps.tolist()
        zz = zi.float()
        for tt in (t, mid):
            zz = d.step(guided(zz.double(), tt).float(), tt, zz).prev_sample
        assert torch.allclose(zz.double(), z_prev, atol=1e-4)


def test_x_from_two_steps_inverts_one_ddim_step():
    g = torch.Generator().manual_seed(1)
    z_t, x = torch.randn(4, 3, 2, 2, generator=g), torch.randn(4, 3, 2, 2, generator=g)
    a_t, a_p = torch.tensor([0.01, 0.2, 0.5, 0.9]), torch.tensor([0.05, 0.4, 0.8, 0.9991])
    eps = (z_t - a_t.sqrt().view(-1, 1, 1, 1) * x) / (1 - a_t).sqrt().view(-1, 1, 1, 1)
    z_p = a_p.sqrt().view(-1, 1, 1, 1) * x + (1 - a_p).sqrt().view(-1, 1, 1, 1) * eps
    assert torch.allclose(x_from_two_steps(z_t, z_p, a_t, a_p), x, atol=1e-4)


def test_guided_target_fused_equals_two_passes_and_w_conditioned_teacher_is_one_pass():
    g = torch.Generator().manual_seed(2)
    z = torch.randn(2, 4, 2, 2, generator=g)
    cond, uncond = torch.randn(2, 5, 6, generator=g), torch.randn(1, 5, 6, generator=g)
    t, a = torch.tensor([900, 100]), torch.tensor([0.01, 0.9])
    w = torch.tensor([3.0, 1.5])
    fused = guided_x_target(GuidedTeacher(ToyUNet(), "v_prediction", fused_cfg=True), z, t, a, cond, uncond, w)
    split = guided_x_target(GuidedTeacher(ToyUNet(), "v_prediction", fused_cfg=False), z, t, a, cond, uncond, w)
    assert torch.allclose(fused, split, atol=1e-6)
    calls = []
    toy = ToyUNet(w_dim=8)
    toy.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    guided_x_target(GuidedTeacher(toy, "epsilon"), z, t, a, cond, uncond, w)
    assert calls == [2]  # one pass, batch 2: no unconditional half


def test_loss_weightings():
    a = torch.tensor([0.002, 0.5, 0.999])
    assert torch.allclose(loss_weight(a, "truncated_snr"), torch.stack([torch.tensor(1.0), torch.tensor(1.0), a[2] / (1 - a[2])]))
    # snr_plus_one on x errors equals the plain MSE in v space
    g = torch.Generator().manual_seed(3)
    x, eps, v_hat = (torch.randn(3, 4, 2, 2, generator=g) for _ in range(3))
    z = noisy_latents(x, eps, a)
    sa, s1 = a.sqrt().view(-1, 1, 1, 1), (1 - a).sqrt().view(-1, 1, 1, 1)
    v = sa * eps - s1 * x
    ours = x_space_loss(v_hat, z, a, x, "v_prediction", "snr_plus_one")
    assert torch.allclose(ours, (v_hat - v).pow(2).flatten(1).mean(1).mean(), rtol=1e-4)


# ------------------------------------------------------------------ guidance embedding

@pytest.fixture(scope="module")
def tiny_unet():
    from diffusers import UNet2DConditionModel

    from pocketdiff.models import unet_config

    torch.manual_seed(0)
    return UNet2DConditionModel(**unet_config("tiny", resolution=32)).eval()


def test_guidance_embedding_starts_as_the_teacher(tiny_unet):
    student = add_guidance_embedding(tiny_unet, 16)
    assert is_w_conditioned(student) and not is_w_conditioned(tiny_unet)
    assert student.config.time_cond_proj_dim == 16
    g = torch.Generator().manual_seed(0)
    z, emb = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 77, 64, generator=g)
    t = torch.tensor([10, 700])
    with torch.no_grad():
        ref = tiny_unet(z, t, encoder_hidden_states=emb).sample
        out = student(z, t, encoder_hidden_states=emb, timestep_cond=w_condition([1.0, 7.5], student)).sample
        assert torch.equal(ref, out)
        student.time_embedding.cond_proj.weight.normal_()
        a = student(z, t, encoder_hidden_states=emb, timestep_cond=w_condition([2.0, 2.0], 16)).sample
        b = student(z, t, encoder_hidden_states=emb, timestep_cond=w_embedding_fn(student)(torch.tensor([6.0, 6.0]))).sample
    assert not torch.allclose(a, b)


def test_w_condition_is_the_stock_pipeline_embedding():
    from diffusers import StableDiffusionPipeline

    w = torch.tensor([1.0, 3.5, 8.0])
    ref = StableDiffusionPipeline.get_guidance_scale_embedding(None, w - 1, embedding_dim=32)
    assert torch.allclose(w_condition(w, 32), ref, atol=1e-6)


def test_guided_stage_gives_the_w_embedding_its_own_learning_rate(tiny_unet):
    cfg = load_config(Config, None, ["guidance.embed_lr_scale=20"])
    guided, progressive = plan_rounds(cfg)[:2]
    assert distill.embed_lr_scale(cfg, guided) == {"time_embedding.cond_proj": 20.0}
    assert distill.embed_lr_scale(cfg, progressive) == {}
    assert distill.embed_lr_scale(load_config(Config, None, []), guided) == {}  # default 1: one group
    with pytest.raises(ConfigError, match="guidance.embed_lr_scale"):
        load_config(Config, None, ["guidance.embed_lr_scale=0"])
    # the prefix names a real parameter of a w-conditioned student
    student = add_guidance_embedding(tiny_unet, 8)
    assert "time_embedding.cond_proj.weight" in dict(student.named_parameters())
