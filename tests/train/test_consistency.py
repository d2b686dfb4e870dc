"""Consistency distillation (`distill.method: consistency`): the math against hand computations and
diffusers' LCMScheduler, the target network, the bad-input lines."""
import pytest
import torch

from pocketdiff.config import load_config
from pocketdiff.consistency_sampling import boundary_scalings, lcm_timesteps, skipping_grid
from pocketdiff.sampling import consistency_sample
from pocketdiff.errors import ConfigError, PocketdiffError
from pocketdiff.train.consistency_targets import (
    TargetNetwork,
    consistency_function,
    pseudo_huber,
    skipping_plan,
    solver_step,
)
from pocketdiff.train.distill import Config, plan_rounds

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _lcm(prediction_type="epsilon", solver_steps=50, scaling=10.0):
    from diffusers import LCMScheduler

    return LCMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, prediction_type=prediction_type,
                        original_inference_steps=solver_steps, timestep_scaling=scaling)


# ------------------------------------------------------------------ boundary condition and grid

def test_boundary_condition_holds_at_t_zero_and_the_scalings_are_lcms():
    c_skip, c_out = boundary_scalings(torch.tensor([0]))
    assert c_skip.item() == 1.0 and c_out.item() == 0.0
    sched = _lcm()
    for t in (0, 1, 19, 499, 999):
        ref = sched.get_scalings_for_boundary_condition_discrete(torch.tensor(t))
        ours = boundary_scalings(t, 10.0)
        assert torch.allclose(ours[0], torch.as_tensor(ref[0], dtype=torch.float32)) and torch.allclose(ours[1], torch.as_tensor(ref[1], dtype=torch.float32))
    c_skip, c_out = boundary_scalings(999)
    assert c_skip < 1e-6 and abs(c_out.item() - 1.0) < 1e-6  # far from 0: f is the x0 prediction
    # f(z, 0) = z whatever the model outputs
    z, out = torch.randn(2, 4, 4, 4), torch.randn(2, 4, 4, 4)
    t0 = torch.zeros(2, dtype=torch.long)
    assert torch.equal(consistency_function(out, z, t0, torch.full((2,), 0.999), "epsilon", 10.0), z)


def test_skipping_grid_and_timesteps_match_lcm_scheduler():
    assert skipping_grid(1000, 50).tolist()[:3] == [19, 39, 59] and skipping_grid(1000, 50)[-1] == 999
    for solver, steps in [(50, 1), (50, 2), (50, 4), (50, 8), (50, 50), (20, 3), (8, 8)]:
        sched = _lcm(solver_steps=solver)
        sched.set_timesteps(steps)
        assert lcm_timesteps(1000, solver, steps) == sched.timesteps.tolist(), (solver, steps)
    with pytest.raises(PocketdiffError, match="1 to 50"):
        lcm_timesteps(1000, 50, 51)


def test_skipping_solver_step_equals_a_hand_ddim_jump():
    sched = _lcm("v_prediction", solver_steps=50)
    plan = skipping_plan(sched, 50)
    assert plan.t_hi.tolist()[:2] == [19, 39] and plan.t_lo.tolist()[:2] == [0, 19] and plan.t_lo[-1] == 979
    n = 10  # t_hi = 219 -> t_lo = 199
    a_hi, a_lo = sched.alphas_cumprod[219].double(), sched.alphas_cumprod[199].double()
    assert torch.isclose(plan.a_hi[n].double(), a_hi) and torch.isclose(plan.a_lo[n].double(), a_lo)
    g = torch.Generator().manual_seed(0)
    z, v = torch.randn(2, 4, 3, 3, generator=g), torch.randn(2, 4, 3, 3, generator=g)
    # by hand, in float64: x0 = sqrt(a) z - sqrt(1-a) v; eps = sqrt(a) v + sqrt(1-a) z; z' = sqrt(a') x0 + sqrt(1-a') eps
    zd, vd = z.double(), v.double()
    x0 = a_hi.sqrt() * zd - (1 - a_hi).sqrt() * vd
    eps = a_hi.sqrt() * vd + (1 - a_hi).sqrt() * zd
    expect = a_lo.sqrt() * x0 + (1 - a_lo).sqrt() * eps
    got = solver_step(v, z, plan.a_hi[[n, n]], plan.a_lo[[n, n]], "v_prediction")
    assert torch.allclose(got.double(), expect, atol=1e-5)


def test_pseudo_huber_by_hand():
    a, b = torch.tensor([0.0, 3.0]), torch.tensor([0.0, 0.0])
    c = 0.5
    assert torch.isclose(pseudo_huber(a, b, c), torch.tensor(((9 + 0.25) ** 0.5 - 0.5) / 2))
    assert pseudo_huber(a, a, 1e-3).item() == 0.0


# ------------------------------------------------------------------ sampler

@pytest.fixture(scope="module")
def tiny_student():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
                                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
                                cross_attention_dim=8, attention_head_dim=2, norm_num_groups=4, time_cond_proj_dim=8).eval()


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_consistency_sample_equals_an_lcm_scheduler_loop(tiny_student, steps):
    from pocketdiff.sampling import guidance_scale_embedding

    sched = _lcm("v_prediction")
    cond = torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(1))
    noise = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = consistency_sample(tiny_student, sched, cond, noise.clone(), steps, guidance_scale=3.0,
                                  generator=[torch.Generator().manual_seed(7)])
        ref_sched = _lcm("v_prediction")
        ref_sched.set_timesteps(steps)
        gen, z = torch.Generator().manual_seed(7), noise.clone()
        w_emb = guidance_scale_embedding(torch.tensor([3.0 - 1.0]), 8)
        for t in ref_sched.timesteps:
            out = tiny_student(z, t, encoder_hidden_states=cond, timestep_cond=w_emb).sample
            z, denoised = ref_sched.step(out, t, z, generator=gen, return_dict=False)
    assert torch.allclose(ours, denoised, atol=1e-5)


# ------------------------------------------------------------------ target network

def test_target_network_is_an_ema_of_the_student_and_round_trips(tiny_student):
    target = TargetNetwork(tiny_student, decay=0.75)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    moved = {n: p.detach() + 1.0 for n, p in tiny_student.named_parameters()}
    with torch.no_grad():
        for n, p in tiny_student.named_parameters():
            p.add_(1.0)
    try:
        target.after_update(tiny_student)
        for n in moved:
            assert torch.allclose(target.state_dict()[n], 0.75 * before[n] + 0.25 * moved[n], atol=1e-6), n
        other = TargetNetwork(tiny_student, decay=0.75)
        other.load_state_dict(target.state_dict())
        assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), target.state_dict().values()))
    finally:
        with torch.no_grad():
            for p in tiny_student.parameters():
                p.sub_(1.0)


def test_a_decay_zero_target_is_the_live_student_with_no_copy(tiny_student):
    live, copy = TargetNetwork(tiny_student, decay=0.0), TargetNetwork(tiny_student, decay=0.5)
    assert live.live and live.net is tiny_student and not copy.live and copy.net is not tiny_student
    torch.manual_seed(1)
    z, t, cond, w = torch.randn(2, 4, 8, 8), torch.tensor([10, 500]), torch.randn(2, 3, 8), torch.randn(2, 8)
    assert torch.allclose(live(z, t, cond, w), copy(z, t, cond, w), atol=1e-6)  # the copy equals the student until it moves
    with torch.no_grad():
        next(tiny_student.parameters()).add_(1.0)
    try:
        live.after_update(tiny_student)
        copy.after_update(tiny_student)
        moved = tiny_student(z, t, encoder_hidden_states=cond, timestep_cond=w, return_dict=False)[0]
        assert torch.equal(live(z, t, cond, w), moved) and not torch.allclose(copy(z, t, cond, w), moved, atol=1e-4)
    finally:
        with torch.no_grad():
            next(tiny_student.parameters()).sub_(1.0)


# ------------------------------------------------------------------ the recipe

def test_consistency_plan_is_one_stage_and_progressive_reaches_one_step():
    cfg = load_config(Config, None, ["method=consistency", "consistency.solver_steps=20", "consistency.sample_steps=[1,2,4]",
                                     "consistency.train.max_steps=9"])
    assert [(s.index, s.stage, s.steps, s.teacher_steps, s.max_steps) for s in plan_rounds(cfg)] == [(0, "consistency", 4, 20, 9)]
    cfg = load_config(Config, None, ["progressive.start_steps=8", "progressive.final_steps=1"])
    assert [(s.stage, s.steps, s.teacher_steps) for s in plan_rounds(cfg)] == [
        ("guided", 8, None), ("progressive", 4, 8), ("progressive", 2, 4), ("progressive", 1, 2)]


@pytest.mark.parametrize("overrides,key", [
    (["method=distillation"], "method"),
    (["method=consistency", "consistency.sample_steps=[1,2,64]"], "consistency.sample_steps"),
    (["method=consistency", "consistency.sample_steps=[4,2]"], "consistency.sample_steps"),
    (["method=consistency", "consistency.target_ema_decay=1"], "consistency.target_ema_decay"),
    (["progressive.start_steps=64", "progressive.final_steps=3"], "progressive.final_steps"),
    (["progressive.start_steps=12", "progressive.final_steps=4"], "progressive.final_steps"),
])
def test_bad_recipes_name_their_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(Config, None, overrides)
    message = str(e.value).removeprefix("config: ")  # load_config names the source first
    assert message.startswith(key + ":") and "\n" not in message


@pytest.mark.parametrize("overrides,key", [
    (["method=lcm"], "method: must be one of ('progressive', 'consistency'), got 'lcm'"),
    (["method=consistency", "consistency.sample_steps=[1,100]"], "consistency.sample_steps: 100 cannot be reached"),
    (["progressive.start_steps=64", "progressive.final_steps=3"], "progressive.final_steps: 3 cannot be reached"),
])
def test_bad_input_is_one_line_and_exit_2_on_the_cli(overrides, key, tmp_path, capsys):
    from pocketdiff.cli import main

    code = main(["distill", "--output", str(tmp_path / "o"), *overrides])
    err = capsys.readouterr().err.strip()
    assert code == 2 and key in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o" / "checkpoints").exists()
