"""`model.lora` through the verbs: the CLI refuses bad LoRAs in one line (exit 2, no folder left), every
report carries each LoRA's file, sha256 and scale, evaluate fuses `models[i].lora`, and an exported
bundle's manifest names the LoRA it was made with. (Fusing itself: tests/core/test_lora.py.)"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pocketdiff.cli import main, run_stage
from pocketdiff.config import load_config
from pocketdiff.errors import PocketdiffError
from pocketdiff.lora import LoraSpec, config_lora_entries
from pocketdiff.models import ModelConfig, build_pipeline, load_pipeline, save_pipeline

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SMOKE = "configs/smoke/train-teacher.yaml"
TEACHER_TINY = ["data.shapes_count=8", "data.resolution=32", "vae.steps=1", "vae.batch_size=4", "train.batch_size=4",
                "train.max_steps=1", "train.checkpoint_every=1", "train.log_every=1", "samples.steps=1",
                "samples.prompts=[a red circle]"]
TARGETS = ("down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q", "down_blocks.0.resnets.0.conv1",
           "mid_block.attentions.0.proj_in")
TE_TARGETS = ("encoder.layers.0.self_attn.q_proj", "encoder.layers.1.mlp.fc1")


def kohya_lora(pipe, path: Path, rank: int = 2, seed: int = 0) -> Path:
    """A kohya-format LoRA with random factors on a few of `pipe`'s layers (UNet: linear, 3x3 and 1x1 conv; text encoder)."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for prefix, module, names in (("lora_unet_", pipe.unet, TARGETS), ("lora_te_", pipe.text_encoder, TE_TARGETS)):
        for name in names:
            w = module.get_submodule(name).weight
            key = prefix + ("text_model." if prefix == "lora_te_" else "") + name  # kohya's names keep CLIP's text_model
            key = key.replace(".", "_")
            state[f"{key}.lora_down.weight"] = 0.3 * torch.randn(rank, *w.shape[1:], generator=g)
            state[f"{key}.lora_up.weight"] = 0.3 * torch.randn(w.shape[0], rank, *([1, 1] if w.dim() == 4 else []), generator=g)
            state[f"{key}.alpha"] = torch.tensor(1.0)
    save_file(state, str(path))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora_verbs")
    pipe = build_pipeline(ModelConfig(vocab_size=600), captions=["a red circle", "a blue square"], resolution=32)
    folder = save_pipeline(pipe, root / "tiny")
    return {"root": root, "folder": folder, "lora": kohya_lora(pipe, root / "style.safetensors")}


def _lora_override(path, scale=1.0, key="model.lora") -> str:
    return f"{key}=[{{path: '{path}', scale: {scale}}}]"


def test_the_cli_refuses_a_pickle_lora_in_one_line_and_writes_nothing(tmp_path, capsys):
    evil = tmp_path / "style.pt"
    evil.write_bytes(b"\x80\x04K\x01.")
    out = tmp_path / "run"
    code = main(["train-teacher", "--config", SMOKE, "--output", str(out), *TEACHER_TINY, _lora_override(evil)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "model.lora[0].path" in err[0] and "pickle" in err[0]
    assert not out.exists()


def test_the_cli_refuses_a_lora_of_another_base_naming_its_first_key(tiny, tmp_path, capsys):
    other = tmp_path / "sd15_style.safetensors"
    key = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    save_file({f"{key}.lora_down.weight": torch.ones(4, 320), f"{key}.lora_up.weight": torch.ones(320, 4)}, str(other))
    out = tmp_path / "run"
    code = main(["train-teacher", "--config", SMOKE, "--output", str(out), *TEACHER_TINY,
                 f"model.pretrained={tiny['folder']}", _lora_override(other)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"{key}.lora_down.weight" in err[0] and "does not fit" in err[0]
    assert not out.exists()


def test_the_report_and_config_carry_the_lora_file_sha256_and_scale(tiny, tmp_path):
    out = tmp_path / "run"
    report = run_stage("train-teacher", SMOKE, out, TEACHER_TINY + [f"model.pretrained={tiny['folder']}", "vae.steps=0",
                                                                    _lora_override(tiny["lora"], 0.5)])
    want = [{"key": "model.lora[0]", "file": str(tiny["lora"].resolve()), "scale": 0.5,
             "sha256": hashlib.sha256(tiny["lora"].read_bytes()).hexdigest()}]
    assert report["lora"] == want
    assert json.loads((out / "report.json").read_text())["lora"] == want
    assert "style.safetensors" in (out / "config.yaml").read_text()


def test_every_verb_config_takes_model_lora(tiny):
    """model.lora is one ModelConfig field: each verb whose config embeds `model` takes it (and evaluate, models[i].lora)."""
    import importlib

    from pocketdiff.cli import VERBS

    for verb in ("train-teacher", "distill", "calibrate", "prune", "export"):
        schema = importlib.import_module(VERBS[verb]).Config
        cfg = load_config(schema, None, [_lora_override(tiny["lora"], 0.25)])
        assert cfg.model.lora == [LoraSpec(str(tiny["lora"]), 0.25)], verb
        assert [e["key"] for e in config_lora_entries(cfg)] == ["model.lora[0]"], verb
    schema = importlib.import_module(VERBS["evaluate"]).Config
    cfg = load_config(schema, None, [f"models=[{{path: '{tiny['folder']}', lora: [{{path: '{tiny['lora']}', scale: 2}}]}}]"])
    assert [(e["key"], e["scale"]) for e in config_lora_entries(cfg)] == [("models[0].lora[0]", 2.0)]


def test_export_refuses_a_lora_beside_an_int8_checkpoint(tiny, tmp_path):
    from pocketdiff.export.verb import Config

    with pytest.raises(PocketdiffError, match="model.lora: the int8 checkpoint's weights would replace"):
        load_config(Config, None, ["weights=int8", f"int8.checkpoint={tmp_path}", _lora_override(tiny["lora"])])


def test_evaluate_fuses_models_lora(tiny):
    from pocketdiff.evaluate.generation import ModelSpec, resolve_model

    plain = load_pipeline(str(tiny["folder"]))
    model = resolve_model(ModelSpec(path=str(tiny["folder"]), lora=[{"path": str(tiny["lora"]), "scale": 0.5}]))
    for comp, names in (("unet", TARGETS), ("text_encoder", TE_TARGETS)):
        fused = model.unet if comp == "unet" else model.pipe.text_encoder
        for name in names:
            delta = fused.get_submodule(name).weight - getattr(plain, comp).get_submodule(name).weight
            assert float(delta.abs().max()) > 1e-3, name
    with pytest.raises(PocketdiffError, match=r"models\[0\].lora: fuses into a model loaded from path or build"):
        resolve_model({"name": "given", "pipe": plain, "lora": [{"path": str(tiny["lora"])}]})
    with pytest.raises(PocketdiffError, match="models.lora: applies to pipelines only"):
        ModelSpec(path=str(tiny["folder"]), kind="bundle", lora=[{"path": str(tiny["lora"])}])


def test_the_bundle_manifest_names_the_lora(tiny, tmp_path, monkeypatch):
    """A text-encoder-only export (the quickest conversion): the manifest's provenance lists the LoRA. verify-bundle
    refuses such a bundle (no UNet to run): its check is stubbed here, the manifest is what this test reads."""
    import pocketdiff.runtime.verify_bundle as vb

    monkeypatch.setattr(vb, "verify_bundle", lambda *a, **k: None)
    out = tmp_path / "bundle"
    run_stage("export", None, out, [f"model.pretrained={tiny['folder']}", _lora_override(tiny["lora"], 0.75),
                                    "components=[text_encoder]", "weights=fp32", "verify.delegate=false",
                                    "fp16_scan.enabled=false", "guidance=none"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["provenance"]["lora"] == [{"key": "model.lora[0]", "file": str(tiny["lora"].resolve()), "scale": 0.75,
                                               "sha256": hashlib.sha256(tiny["lora"].read_bytes()).hexdigest()}]


def test_a_distilled_student_keeps_the_lora_in_its_text_encoder(tmp_path):
    """Round folders share the teacher's unchanged components by hardlink; with a LoRA fused into the teacher's text
    encoder, the student's must be the fused one, not the file in the teacher's folder."""
    from pocketdiff.models import embedded_teacher_dir

    teacher = load_pipeline(str(embedded_teacher_dir()))
    lora = kohya_lora(teacher, tmp_path / "style.safetensors")
    out = tmp_path / "run"
    run_stage("distill", "configs/smoke/distill.yaml", out, [
        _lora_override(lora, 0.5), "guided.enabled=false", "progressive.start_steps=4", "progressive.final_steps=2",
        "progressive.train.max_steps=1", "progressive.train.checkpoint_every=1", "data.shapes_count=8",
        "eval.num_images=2", "eval.prompts=[a red circle]"])
    folders = sorted(p.parent for p in out.rglob("model_index.json"))
    assert folders, "distill wrote no pipeline folder"
    student = load_pipeline(str(folders[-1]))
    for name in TE_TARGETS:
        delta = student.text_encoder.get_submodule(name).weight - teacher.text_encoder.get_submodule(name).weight
        assert float(delta.abs().max()) > 1e-3, name
