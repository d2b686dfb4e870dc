"""The shipped `pocketdiff distill` recipes load through the config validation (a file added under
configs/ is picked up by the globs), and the SD-2.1 consistency recipes keep the memory options of
the progressive ones: the settings that fit a 24 GB GPU are the same for both methods."""
from __future__ import annotations

from pathlib import Path

import pytest

from pocketdiff.config import load_config
from pocketdiff.train.distill import Config, accelerator_section, plan_rounds

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
# every distill recipe: the SD-2.1 ones, the domain ones (evaluate_* in configs/distill/ are `pocketdiff evaluate`'s),
# the smoke and the demo
RECIPES = sorted({*CONFIGS.glob("sd21/distill*.yaml"), *(p for p in CONFIGS.glob("distill/*.yaml") if not p.name.startswith("evaluate_")),
                  *CONFIGS.glob("smoke/distill.yaml"), *CONFIGS.glob("smoke/distill-lcm.yaml"), CONFIGS / "demo" / "distill.yaml"})
# the train: keys that decide memory and precision on the GPU
MEMORY_KEYS = ("batch_size", "mixed_precision", "gradient_checkpointing", "optimizer", "optimizer_lib", "ema_device", "memory_cap_gib")


def _load(rel: str) -> Config:
    return load_config(Config, CONFIGS / rel)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_distill_recipe_validates(path):
    cfg = load_config(Config, path)
    assert plan_rounds(cfg)


def test_the_globs_see_the_sd21_consistency_recipes():
    names = {str(p.relative_to(CONFIGS)) for p in RECIPES}
    assert {"sd21/distill.yaml", "sd21/distill_smoke.yaml", "sd21/distill_lcm.yaml", "sd21/distill_lcm_smoke.yaml",
            "distill/openmoji_lcm.yaml"} <= names


@pytest.mark.parametrize("lcm, progressive", [("sd21/distill_lcm.yaml", "sd21/distill.yaml"),
                                              ("sd21/distill_lcm_smoke.yaml", "sd21/distill_smoke.yaml")])
def test_sd21_consistency_recipes_keep_the_progressive_memory_options(lcm, progressive):
    c, p = _load(lcm), _load(progressive)
    assert c.method == "consistency" and p.method == "progressive"
    [stage] = plan_rounds(c)
    assert (stage.stage, stage.steps, stage.teacher_steps) == ("consistency", max(c.consistency.sample_steps), c.consistency.solver_steps)
    ct, pt = c.consistency.train, p.progressive.train
    assert accelerator_section(c) is ct  # the memory cap and precision come from this section
    assert {k: getattr(ct, k) for k in MEMORY_KEYS} == {k: getattr(pt, k) for k in MEMORY_KEYS}
    assert ct.gradient_checkpointing and (ct.optimizer, ct.optimizer_lib, ct.ema_device) == ("adamw8bit", "bitsandbytes", "cpu")
    assert ct.ema_decay > 0 and c.speed.teacher_dtype == p.speed.teacher_dtype == "bf16"
    assert (c.speed.fused_cfg, c.speed.channels_last) == (p.speed.fused_cfg, p.speed.channels_last)
    assert (c.guidance.w_min, c.guidance.w_max, c.guidance.embed_dim) == (p.guidance.w_min, p.guidance.w_max, p.guidance.embed_dim)
    assert (c.data.source, c.data.resolution, c.model.arch, c.model.prediction_type) == \
        (p.data.source, p.data.resolution, p.model.arch, p.model.prediction_type)
    assert c.student_prediction_type == "teacher"  # the student starts as the (epsilon) teacher


def test_the_sd21_consistency_smoke_is_a_few_capped_steps():
    cfg = _load("sd21/distill_lcm_smoke.yaml")
    t = cfg.consistency.train
    assert t.max_steps <= 10 and t.memory_cap_gib == 24 and t.checkpoints_total_limit == 1
    assert cfg.model.pretrained is None and cfg.model.arch == "sd21" and cfg.data.source == "shapes"
    assert cfg.eval.reference_steps and cfg.eval.reference_steps <= 8  # not progressive.start_steps' 64 at 512 px
    header = (CONFIGS / "sd21" / "distill_lcm_smoke.yaml").read_text().splitlines()[0:10]
    assert any("pocketdiff distill --config configs/sd21/distill_lcm_smoke.yaml" in line for line in header)
