"""The evaluate verb end to end on tiny models, compare mode, guidance modes, hooks."""
from __future__ import annotations

import json

import pytest
import torch

from pocketdiff.cli import main
from pocketdiff.config import DataConfig
from pocketdiff.errors import PocketdiffError
from pocketdiff.evaluate import MetricConfig, MetricSetup, ModelSpec, evaluate_pipelines
from pocketdiff.evaluate.generation import generate_images, resolve_model

REF = DataConfig(source="shapes", shapes_count=48, resolution=32)


def _yaml(path, pipeline_dir, clip_dir, cache, extra=""):
    path.write_text(
        f"models:\n  - {{name: teacher, path: {pipeline_dir}}}\n  - {{name: rand, build: tiny, guidance_mode: none}}\n"
        f"reference: {{source: shapes, shapes_count: 48, resolution: 32}}\n"
        f"prompts: {{from_reference: 6}}\n"
        f"metrics: {{features: clip, clip: {clip_dir}, cache_dir: {cache}, reference_clip_samples: 8}}\n"
        f"steps: [1, 2]\nseeds: [0, 7]\nguidance_scale: 2.0\ngrid_prompts: 3\n" + extra
    )


def test_evaluate_verb_writes_report_page_grids_and_compares(tmp_path, tiny_pipeline_dir, tiny_clip_dir):
    cfg = tmp_path / "e.yaml"
    _yaml(cfg, tiny_pipeline_dir, tiny_clip_dir, tmp_path / "cache")
    out = tmp_path / "run1"
    assert main(["evaluate", "--config", str(cfg), "--output", str(out)]) == 0
    rep = json.loads((out / "report.json").read_text())
    res = rep["results"]
    assert [(r["model"], r["steps"]) for r in res] == [("teacher", 1), ("teacher", 2), ("rand", 1), ("rand", 2)]
    for r in res:
        assert {"model", "steps", "fd", "clip_score", "features", "num_samples"} <= set(r)
        assert r["features"] == "FD (tinytest-CLIP)" and r["num_samples"] == 6 and r["num_seeds"] == 2
        assert len(r["fd_per_seed"]) == 2 and r["fd_std"] is not None and r["fd"] > 0
    assert res[0]["guidance_mode"] == "cfg" and res[0]["guidance_scale"] == 2.0
    assert res[2]["guidance_mode"] == "none" and res[2]["guidance_scale"] == 1.0
    assert any("6 samples per seed" in w for w in rep["warnings"])  # small-N warning
    assert rep["metrics"]["reference"]["num_images"] == 48 and "fd_real_subset" in rep["metrics"]["reference"]
    page = (out / "index.html").read_text()
    assert "FD (tinytest-CLIP)" in page and "samples / seed" in page and "Warnings" in page
    for name in ("grid-1steps.png", "grid-2steps.png", "fd_vs_steps.png", "clip_score_vs_steps.png"):
        assert (out / name).is_file(), name
    assert len(list((out / "images").glob("grid-2steps-teacher-*.png"))) == 3

    # compare mode over the earlier run, no new models
    cmp_cfg = tmp_path / "c.yaml"
    cmp_cfg.write_text(f"compare: [{out}, {out}]\n")
    out2 = tmp_path / "cmp"
    assert main(["evaluate", "--config", str(cmp_cfg), "--output", str(out2)]) == 0
    rep2 = json.loads((out2 / "report.json").read_text())
    assert len(rep2["compare"]) == 8 and rep2["results"] == []
    assert "Compare runs" in (out2 / "index.html").read_text()


def test_same_seed_same_images_across_runs(tiny_pipeline_dir):
    model = resolve_model(ModelSpec(path=str(tiny_pipeline_dir)))
    a, _ = generate_images(model, ["a red circle", "a blue star"], 2, 2.0, seed=3, batch_size=1)
    b, _ = generate_images(model, ["a red circle", "a blue star"], 2, 2.0, seed=3, batch_size=2)
    assert torch.allclose(a, b, atol=1e-5)


def _pipe_with_unet(tiny_pipeline_dir, **unet_changes):
    from diffusers import UNet2DConditionModel

    from pocketdiff.models import load_pipeline

    pipe = load_pipeline(str(tiny_pipeline_dir))
    config = dict(pipe.unet.config)
    config.update(unet_changes)
    torch.manual_seed(0)
    pipe.unet = UNet2DConditionModel.from_config(config).eval()
    return pipe


def test_w_conditioned_student_through_timestep_cond(tiny_pipeline_dir):
    pipe = _pipe_with_unet(tiny_pipeline_dir, time_cond_proj_dim=32)
    model = resolve_model(("student", pipe))
    assert model.guidance_mode == "embedded"
    w1, _ = generate_images(model, ["a red circle"], 2, 1.0, seed=0)
    w5, _ = generate_images(model, ["a red circle"], 2, 5.0, seed=0)
    assert not torch.allclose(w1, w5)
    with pytest.raises(PocketdiffError, match="w-conditioned"):
        resolve_model({"name": "s", "pipe": pipe, "guidance_mode": "cfg"})


def test_w_conditioned_student_through_class_labels(tiny_pipeline_dir):
    pipe = _pipe_with_unet(tiny_pipeline_dir, class_embed_type="timestep")
    model = resolve_model({"name": "s", "pipe": pipe})
    assert model.guidance_mode == "embedded" and model.w_embedding_fn is not None
    w1, _ = generate_images(model, ["a red circle", "a star"], 2, 1.0, seed=0, batch_size=1)
    w5, _ = generate_images(model, ["a red circle", "a star"], 2, 5.0, seed=0, batch_size=2)
    assert w1.shape == (2, 3, 32, 32) and not torch.allclose(w1, w5)
    with pytest.raises(PocketdiffError, match="takes no w"):
        resolve_model(ModelSpec(path=str(tiny_pipeline_dir), guidance_mode="embedded"))


def test_distilled_folder_defaults_come_from_distill_json(tiny_pipeline_dir, tmp_path):
    import shutil

    folder = tmp_path / "round-2"
    shutil.copytree(tiny_pipeline_dir, folder)
    (folder / "distill.json").write_text(json.dumps({"pocketdiff_distill": 1, "num_inference_steps": 2,
                                                     "guidance": {"conditioned": False, "scale": 2.5}}))
    model = resolve_model(ModelSpec(path=str(folder)))
    assert model.guidance_mode == "none" and model.default_steps == [2] and model.default_guidance == 2.5


def test_bundle_hook_says_what_it_needs(tmp_path, tiny_clip_dir):
    setup = MetricSetup(MetricConfig(features="clip", clip=str(tiny_clip_dir), fd=False))
    with pytest.raises(PocketdiffError, match="bundle"):
        evaluate_pipelines([ModelSpec(name="b", kind="bundle", path=str(tmp_path))], ["a", "b"], [2], setup)


def test_library_api_with_pipeline_objects(tiny_pipeline_dir, tiny_clip_dir, tmp_path):
    from pocketdiff.evaluate import compare_images
    from pocketdiff.models import load_pipeline

    setup = MetricSetup(MetricConfig(features="clip", clip=str(tiny_clip_dir), cache_dir=str(tmp_path / "c"),
                                     reference_clip_samples=0), reference=REF)
    pipe = load_pipeline(str(tiny_pipeline_dir))
    prompts = setup.reference_captions()[:4]
    res = evaluate_pipelines([("a", pipe)], prompts, [1], setup, out_dir=None, guidance_scale=1.0, grid_prompts=0)
    assert len(res) == 1 and res[0]["model"] == "a" and res[0]["num_samples"] == 4
    images, _ = generate_images(resolve_model(("a", pipe)), prompts, 1, 1.0, seed=0)
    got = compare_images(images, prompts, reference_images=images, setup=setup)
    assert abs(got["fd"]) < 1e-3 and "clip_score" in got and got["num_samples"] == 4


def test_folder_declared_loader_modules_are_imported_or_named(tmp_path, tiny_pipeline_dir):
    import shutil

    from pocketdiff.models import import_declared_classes

    assert import_declared_classes(str(tiny_pipeline_dir)) == []  # stock folder: nothing to import
    folder = tmp_path / "custom"
    shutil.copytree(tiny_pipeline_dir, folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["unet"] = ["pocketdiff.no_such_module", "SomeUNet"]
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(PocketdiffError, match="pocketdiff.no_such_module.SomeUNet, which cannot be imported"):
        resolve_model(ModelSpec(path=str(folder)))
    (folder / "unet" / "pruning.json").write_text("{}")
    with pytest.raises(PocketdiffError, match="is a pruned UNet"):
        resolve_model(ModelSpec(path=str(tiny_pipeline_dir), unet=str(folder / "unet")))


def test_resolution_that_does_not_fit_the_model_is_refused_naming_the_key(tmp_path, tiny_pipeline_dir, tiny_clip_dir, capsys):
    cfg = tmp_path / "e.yaml"
    _yaml(cfg, tiny_pipeline_dir, tiny_clip_dir, tmp_path / "cache", extra="resolution: 36\n")
    out = tmp_path / "run"
    assert main(["evaluate", "--config", str(cfg), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "resolution=36 does not fit the model" in err
    assert not (out / "report.json").exists()


def test_scheduler_overrides_change_the_grid_not_the_folder_or_the_callers_pipeline(tiny_pipeline_dir):
    from pocketdiff.sampling import scheduler_timesteps

    plain = resolve_model(ModelSpec(path=str(tiny_pipeline_dir)))
    assert plain.pipe.scheduler.config.timestep_spacing == "leading"  # the tiny pipeline's own grid
    trailing = resolve_model(ModelSpec(path=str(tiny_pipeline_dir), scheduler={"timestep_spacing": "trailing"}))
    assert scheduler_timesteps(trailing.pipe.scheduler, 4).tolist() != scheduler_timesteps(plain.pipe.scheduler, 4).tolist()
    a = generate_images(plain, ["a red circle"], 2, 3.0, seed=0)[0]
    b = generate_images(trailing, ["a red circle"], 2, 3.0, seed=0)[0]
    assert not torch.equal(a, b)
    again = resolve_model(ModelSpec(path=str(tiny_pipeline_dir)))  # the folder is unchanged
    assert again.pipe.scheduler.config.timestep_spacing == "leading"
    # a pipeline object passed in keeps its scheduler
    before = dict(plain.pipe.scheduler.config)
    resolve_model({"name": "x", "pipe": plain.pipe, "scheduler": {"timestep_spacing": "linspace"}})
    assert dict(plain.pipe.scheduler.config) == before
    with pytest.raises(PocketdiffError, match=r"models\[0\].*scheduler.*not_a_key"):
        resolve_model(ModelSpec(path=str(tiny_pipeline_dir), scheduler={"not_a_key": 1}))
    with pytest.raises(PocketdiffError, match=r"scheduler.*timestep_spacing must be"):
        resolve_model(ModelSpec(path=str(tiny_pipeline_dir), scheduler={"timestep_spacing": "sideways"}))
