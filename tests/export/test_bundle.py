"""One full `pocketdiff export` (the shipped tiny teacher, int8 UNet from an RTN checkpoint in
compress's format, fp16 text encoder / decoder) shared by every test here, then run-bundle."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from pocketdiff.cli import main as cli_main

TEACHER = "pocketdiff:shapes-teacher"


@pytest.fixture(scope="module")
def exported(teacher_int8_bundle):
    """tests/export/conftest.py's session export (test_unet_chunks.py runs it as its whole UNet)."""
    return teacher_int8_bundle


def test_report_has_every_component_fully_accelerated_with_parity(exported):
    rep = exported["report"]
    assert Path(rep["bundle_dir"]) == exported["out"].resolve()
    for name in ("text_encoder", "unet", "vae_decoder"):
        c = rep["components"][name]
        for key in ("file", "fully_accelerated", "cosine", "psnr_db", "bytes", "ops"):
            assert key in c, (name, key)
        assert c["fully_accelerated"] is True
        assert c["cosine"] > 0.999 and c["psnr_db"] > 30
        assert (exported["out"] / c["file"]).stat().st_size == c["bytes"]
        assert c["details"]["parity"]["fp32"]["cosine"] > 0.99999
        assert "BROADCAST_TO" not in c["ops"]
        # every weight-bearing Linear became a 1x1 conv (a FULLY_CONNECTED may remain as a
        # matmul of two activations, never with a constant / dequantized weight)
        from pocketdiff.runtime.tflite_file import TfliteModel

        m = TfliteModel(exported["out"] / c["file"])
        fc_weights = [t for op in m.graph.operators if m.op_name(op) == "FULLY_CONNECTED"
                      for t in op.inputs[1:2] if m.is_constant(t) or t in m.producers()
                      and m.op_name(m.graph.operators[m.producers()[t]]) == "DEQUANTIZE"]
        assert not fc_weights, name
    assert rep["components"]["unet"]["weights"] == "int8"
    assert rep["components"]["text_encoder"]["weights"] == "fp16"
    assert rep["fp16_scan"] is not None


def test_int8_codes_in_the_tflite_equal_the_checkpoint_bit_for_bit(exported, int8_checkpoint):
    from pocketdiff.compress.quant.int8_format import load_quantized
    from pocketdiff.runtime.tflite_file import TfliteModel

    state, recipe = load_quantized(int8_checkpoint)
    tensors = TfliteModel(exported["out"] / "unet.tflite").int8_weights()
    mapping = json.loads((exported["out"] / "_export" / "unet_int8_map.json").read_text())
    outside = set(exported["report"]["components"]["unet"]["details"]["int8_layers_outside_graph"])
    assert outside == {n for n in recipe.layers if n.startswith("time_embedding.")}  # computed outside the graph
    assert set(mapping) == set(recipe.layers) - outside
    checked = 0
    for layer, places in mapping.items():
        codes = state[f"{layer}.weight"]
        scale = state[f"{layer}.weight_scale"]
        for p in places:
            t = tensors[p["tensor"]]
            got = t["codes"]
            if p["layout"] == "ohwi":
                got = got.transpose(0, 3, 1, 2)
            r0, r1 = p["rows"]
            c0, c1 = p["cols"]
            want = codes[r0:r1, c0:c1].numpy().reshape(got.shape)
            assert got.dtype == np.int8 and np.array_equal(got, want), layer
            factor = p["scale_factor"] or 1.0
            assert factor in (1.0, 0.25) or layer.endswith(("to_q", "to_k")), (layer, factor)
            np.testing.assert_allclose(t["scale"], scale[r0:r1].numpy() * factor, rtol=1e-6)
            writes_stream = layer == "conv_in" or layer.endswith(("conv2", "proj_out"))
            assert (factor == 0.25) == writes_stream, (layer, factor)
            assert t["axis"] == 0 and not t["zero_point"].any()
            checked += 1
    assert checked == exported["report"]["components"]["unet"]["details"]["int8_tensors"] > 10


def test_manifest_goldens_and_tokenizer(exported):
    from pocketdiff.runtime.bundle import load_manifest
    from pocketdiff.runtime.delegate import run_on_delegate
    from pocketdiff.runtime.parity import metrics
    from pocketdiff.runtime.run_bundle import bundle_tokenize

    man = load_manifest(exported["out"])
    assert man["schema_version"] == 3 and man["guidance"]["unet_batch"] == 2
    assert man["scheduler"]["timesteps"] == sorted(man["scheduler"]["timesteps"], reverse=True)
    tok = man["tokenizer"]
    ids = bundle_tokenize(tok["files"]["tokenizer.json"]["_path"], tok["golden"]["prompt"], tok)
    assert ids.tolist() == tok["golden"]["ids"]
    for name, entry in man["components"].items():
        g = np.load(entry["golden"]["_path"])
        feeds = {i["name"]: g[f"input_{i['name']}"] for i in entry["inputs"]}
        run = run_on_delegate(entry["_path"], feeds, accelerator="cpu")
        assert metrics(g["output_0"], run.outputs["fp32"][0])["cosine"] > 0.9999, name


def test_run_bundle_gpu_and_pipelined_cpu(exported, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the default GPU program cache goes there
    out = exported["out"]
    assert cli_main(["run-bundle", str(out), "--prompt", "a red circle", "--output", str(tmp_path / "gpu")]) == 0
    rep = json.loads((tmp_path / "gpu" / "report.json").read_text())
    for key in ("image", "accelerator", "fully_accelerated", "latency_s", "host_peak_mb", "start_s", "total_s", "memory"):
        assert key in rep
    assert "peak_model_mb" not in rep  # file bytes are never reported under a memory name
    assert rep["host_peak_mb"] > 50 and 0 < rep["start_s"] < rep["total_s"]
    assert {p["phase"] for p in rep["memory"]["phases"]} >= {"opened", "compiled", "first_run"}
    assert set(rep["memory"]["gpu_cache"]["hits"]) == {"text_encoder", "unet", "vae_decoder"}
    assert rep["accelerator"] == "gpu" and rep["fully_accelerated"] is True
    assert Path(rep["image"]).is_file()
    from PIL import Image

    assert Image.open(rep["image"]).size == (32, 32)
    assert cli_main(["run-bundle", str(out), "--prompt", "a red circle", "--output", str(tmp_path / "cpu"), "--accelerator", "cpu"]) == 0
    assert cli_main(["run-bundle", str(out), "--prompt", "a red circle", "--output", str(tmp_path / "pipe"), "--accelerator", "cpu", "--pipelined"]) == 0
    plain = json.loads((tmp_path / "cpu" / "report.json").read_text())
    piped = json.loads((tmp_path / "pipe" / "report.json").read_text())
    assert piped["pipelined"] and not plain["pipelined"]
    assert _resident_at_most_one(piped["memory"]["phases"]) and not _resident_at_most_one(plain["memory"]["phases"])
    a = np.asarray(Image.open(plain["image"]), dtype=np.float32)
    b = np.asarray(Image.open(piped["image"]), dtype=np.float32)
    assert np.abs(a - b).max() <= 1.0  # same computation, only the loading order differs
    # nothing is written over an existing output without --overwrite
    assert cli_main(["run-bundle", str(out), "--prompt", "x", "--output", str(tmp_path / "cpu"), "--accelerator", "cpu"]) == 2


def _resident_at_most_one(phases: list) -> bool:
    """From the runner's measured phases: never two models loaded (or compiling) at once."""
    resident: set = set()
    for p in phases:
        if p["phase"] == "opened":
            if resident:
                return False
            resident.add(p["component"])
        elif p["phase"] == "released":
            resident.discard(p["component"])
    return True


def test_bundle_image_matches_the_torch_pipeline(exported):
    """Same initial noise: run-bundle's DDIM + models (CPU) against pocketdiff.sampling in torch."""
    from pocketdiff.compress.quant.int8_format import dequantized_state_dict, load_quantized
    from pocketdiff.runtime.bundle import load_manifest
    from pocketdiff.runtime.parity import metrics
    from pocketdiff.runtime.run_bundle import generate
    from pocketdiff.models import ModelConfig, load_or_build
    from pocketdiff.sampling import ddim_sample, decode_latents, encode_prompts

    man = load_manifest(exported["out"])
    pipe = load_or_build(ModelConfig(pretrained=TEACHER))
    cfg = yaml.safe_load(exported["config"].read_text())
    state, recipe = load_quantized(cfg["int8"]["checkpoint"])
    pipe.unet.load_state_dict(dequantized_state_dict(state, recipe))
    noise = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(5))
    prompt = "a small blue square at the top left"
    with torch.no_grad():
        lat = ddim_sample(pipe.unet, pipe.scheduler, encode_prompts(pipe, prompt), encode_prompts(pipe, ""),
                          steps=man["scheduler"]["steps"], guidance_scale=man["guidance"]["scale"], latents=noise)
        ref = decode_latents(pipe.vae, lat)[0].permute(1, 2, 0).numpy()
    image, stats = generate(exported["out"], prompt, accelerator="cpu", init_latents=noise.numpy(), manifest=man)
    m = metrics(ref, image)
    assert stats["finite"] and m["cosine"] > 0.999 and m["psnr_db"] > 30, m


def test_bundle_runner_loads_once_for_several_prompts(exported):
    """Plain: every model loads at the first prompt only; pipelined: each model loads just in time
    and is released after its use, for every prompt. Images equal one-shot `generate`'s."""
    from pocketdiff.runtime.run_bundle import BundleRunner, generate

    out = exported["out"]
    ref, _ = generate(out, "a blue star", seed=3, accelerator="cpu")
    for pipelined in (False, True):
        with BundleRunner(out, "cpu", pipelined=pipelined) as runner:
            first = runner.run("a red circle", seed=2)[1]
            image, second = runner.run("a blue star", seed=3)
            resident = set(runner.loaded)
        loads = lambda st: sorted(k[: -len("_load")] for k in st["latency_s"] if k.endswith("_load"))  # noqa: E731
        assert loads(first) == ["text_encoder", "unet", "vae_decoder"]
        assert loads(second) == (["text_encoder", "unet", "vae_decoder"] if pipelined else [])
        assert resident == (set() if pipelined else {"text_encoder", "unet", "vae_decoder"})
        assert second["latency_s"]["unet_step_mean"] > 0 and second["finite"]
        assert set(second["fully_accelerated_by_component"]) == {"text_encoder", "unet", "vae_decoder"}
        assert np.abs(image - ref).max() < 1e-5
    assert not runner.loaded  # closed by the with block


def _copy_bundle(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("_export"))
    return dst


def test_run_bundle_refuses_bad_bundles(exported, tmp_path, capsys):
    from pocketdiff.runtime.tflite_file import sha256_file

    def run(bundle: Path, name: str) -> str:
        code = cli_main(["run-bundle", str(bundle), "--prompt", "x", "--output", str(tmp_path / name), "--accelerator", "cpu"])
        assert code == 2
        return capsys.readouterr().err

    # sha256 mismatch
    b = _copy_bundle(exported["out"], tmp_path / "sha")
    data = (b / "vae_decoder.tflite").read_bytes()
    (b / "vae_decoder.tflite").write_bytes(data[:-100] + bytes(100))
    assert "sha256 mismatch" in run(b, "o1")
    # truncated .tflite whose sha256 the manifest agrees with
    b = _copy_bundle(exported["out"], tmp_path / "trunc")
    path = b / "unet.tflite"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    man = json.loads((b / "manifest.json").read_text())
    man["components"]["unet"]["sha256"] = sha256_file(path)
    (b / "manifest.json").write_text(json.dumps(man))
    err = run(b, "o2")
    assert "truncated" in err or "corrupted" in err
    # a manifest path escaping the bundle folder
    b = _copy_bundle(exported["out"], tmp_path / "escape")
    man = json.loads((b / "manifest.json").read_text())
    man["components"]["text_encoder"]["path"] = "../escape_target.tflite"
    (b / "manifest.json").write_text(json.dumps(man))
    shutil.copy(b / "text_encoder.tflite", tmp_path / "escape_target.tflite")
    assert "escapes the bundle" in run(b, "o3")
    b = _copy_bundle(exported["out"], tmp_path / "abs")
    man = json.loads((b / "manifest.json").read_text())
    man["tokenizer"]["files"]["tokenizer.json"]["path"] = str(b / "tokenizer" / "tokenizer.json")
    (b / "manifest.json").write_text(json.dumps(man))
    assert "escapes the bundle" in run(b, "o4")
    assert not (tmp_path / "o1").exists()  # refused before the output folder was made


def test_export_does_not_overwrite_a_bundle(exported, capsys):
    code = cli_main(["export", "--config", str(exported["config"]), "--output", str(exported["out"])])
    assert code == 2
    assert "--overwrite" in capsys.readouterr().err


def test_evaluate_reads_the_bundle_through_the_export_interface(exported):
    """evaluate's `kind: bundle` goes through pocketdiff.runtime.bundle_images: the bundle's
    steps become the default, images match the runner's, a cfg bundle takes another scale,
    and a step count the bundle was not exported for is refused before anything runs."""
    from pocketdiff.errors import PocketdiffError
    from pocketdiff.evaluate.generation import ModelSpec, generate_images, resolve_model
    from pocketdiff.runtime.run_bundle import generate

    out = exported["out"]
    model = resolve_model(ModelSpec(name="b", kind="bundle", path=str(out)))
    assert model.guidance_mode == "cfg" and model.default_steps == [4]
    images, _ = generate_images(model, ["a red circle", "a blue star"], 4, 3.0, seed=7)
    assert images.shape == (2, 3, 32, 32) and images.dtype == torch.float32
    ref, _ = generate(out, "a blue star", seed=8)  # image i is seeded seed + i
    assert np.abs(images[1].numpy().transpose(1, 2, 0) - ref).max() < 1e-4
    w1, _ = generate_images(model, ["a red circle"], 4, 1.0, seed=7)
    assert (w1[0] - images[0]).abs().max() > 1e-2  # the scale reaches the runner
    with pytest.raises(PocketdiffError, match="exported for 4 steps"):
        generate_images(model, ["a red circle"], 2, 3.0, seed=7)
    with pytest.raises(PocketdiffError, match="exported for 4 steps"):
        resolve_model(ModelSpec(name="b", kind="bundle", path=str(out), steps=[8]))
