"""run-bundle checks a bundle's manifest and files before running it (runtime/manifest_check.py).

Table-driven, through the CLI (in process): each case breaks one thing in a copy of the
synthetic bundle (conftest.py; its .tflite files carry real signatures) and asserts exit 2,
exactly one `error:` line naming the manifest field or file and the check, no traceback,
and no --output created. The first four cases are the ones issue 21 found running.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from bundle_builders import IO, T, sha256, signature_tflite

from pocketdiff.cli import main
from pocketdiff.runtime.manifest_check import check_bundle, manifest_problems
from pocketdiff.scheduler_blocks import ddim_timesteps


def _rehash(b: Path, entry: dict) -> None:
    p = b / entry["path"]
    entry["sha256"], entry["bytes"] = sha256(p), p.stat().st_size


def _swap_unet_for_text_encoder(b: Path, m: dict) -> None:
    shutil.copyfile(b / "text_encoder.tflite", b / "unet.tflite")
    _rehash(b, m["components"]["unet"])


def _decoder_of_64px(b: Path, m: dict) -> None:
    ins, _ = IO["vae_decoder"]
    (b / "vae_decoder.tflite").write_bytes(signature_tflite(ins, {"output_0": ([1, 3, 64, 64], "float32")}))
    m["components"]["vae_decoder"]["outputs"][0]["shape"] = [1, 3, 64, 64]
    _rehash(b, m["components"]["vae_decoder"])


def _narrow_time_table(b: Path, m: dict) -> None:
    np.save(b / "time_embedding.npy", np.zeros((T, 8), np.float32))
    _rehash(b, m["time_embedding"])


def _set(path: str, value) -> Callable[[Path, dict], None]:
    """Edit one manifest field: `scheduler.timesteps[0]`-style dotted path."""
    def edit(b: Path, m: dict) -> None:
        keys = path.replace("[", ".").replace("]", "").split(".")
        node = m
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node[k]
        last = keys[-1]
        if value is DELETE:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value(node[last]) if callable(value) else value
    return edit


DELETE = object()


@dataclasses.dataclass
class Case:
    id: str
    edit: Callable[[Path, dict], None]
    culprits: list[str]


CASES = [
    # found by issue 21
    Case("timesteps-empty", _set("scheduler.timesteps", []), ["scheduler.timesteps", "non-empty", "present check"]),
    Case("timestep-5000", _set("scheduler.timesteps[0]", 5000), ["scheduler.timesteps[0]", "5000", "[0, 1000)", "range check"]),
    Case("alpha-nan", _set("scheduler.alphas_cumprod[10]", float("nan")), ["scheduler.alphas_cumprod[10]", "nan", "range check"]),
    Case("unet-file-is-the-text-encoder", _swap_unet_for_text_encoder, ["unet.tflite", "input_ids", "components.unet", "signature check"]),
    # the schedule
    Case("timestep-float", _set("scheduler.timesteps[1]", 501.0), ["scheduler.timesteps[1]", "integer", "type check"]),
    Case("timesteps-ascending", _set("scheduler.timesteps", [1, 251, 501, 751]), ["scheduler.timesteps[1]", "strictly decrease", "order check"]),
    Case("timestep-off-the-spacing", _set("scheduler.timesteps[1]", 500), ["scheduler.timesteps[1]", "leading spacing", "501", "spacing check"]),
    Case("steps-not-the-timestep-count", _set("scheduler.steps", 5), ["scheduler.timesteps", "scheduler.steps is 5", "consistency check"]),
    Case("spacing-unknown", _set("scheduler.timestep_spacing", "cosine"), ["scheduler.timestep_spacing", "cosine", "value check"]),
    Case("alpha-above-1", _set("scheduler.alphas_cumprod[0]", 1.5), ["scheduler.alphas_cumprod[0]", "(0, 1]", "range check"]),
    Case("alpha-zero", _set("scheduler.alphas_cumprod[999]", 0.0), ["scheduler.alphas_cumprod[999]", "range check"]),
    Case("alphas-rising", _set("scheduler.alphas_cumprod[500]", 0.99), ["scheduler.alphas_cumprod[500]", "order check"]),
    Case("alphas-one-short", _set("scheduler.alphas_cumprod", lambda a: a[:-1]), ["scheduler.alphas_cumprod", "999 values", "consistency check"]),
    Case("final-alpha-inf", _set("scheduler.final_alpha_cumprod", float("inf")), ["scheduler.final_alpha_cumprod", "range check"]),
    Case("prediction-type-unknown", _set("scheduler.prediction_type", "sample"), ["scheduler.prediction_type", "sample", "value check"]),
    Case("eta-not-zero", _set("scheduler.eta", 0.5), ["scheduler.eta", "value check"]),
    # sizes and guidance
    Case("latent-not-image-over-vae-factor", _set("latent.height", 16), ["latent.height", "image.height 32", "consistency check"]),
    Case("decoder-file-makes-64px", _decoder_of_64px, ["components.vae_decoder.outputs", "[1, 3, 64, 64]", "[1, 3, 32, 32]", "consistency check"]),
    Case("cfg-with-unet-batch-1", _set("guidance.unet_batch", 1), ["guidance.unet_batch", "consistency check"]),
    Case("guidance-scale-nan", _set("guidance.scale", float("nan")), ["guidance.scale", "value check"]),
    Case("tokenizer-length-not-the-encoder-input", _set("tokenizer.max_length", 77), ["components.text_encoder.inputs.input_ids", "tokenizer.max_length"]),
    Case("decoder-missing-from-manifest", _set("components.vae_decoder", DELETE), ["components.vae_decoder", "missing", "present check"]),
    # files against the manifest
    Case("component-bytes-wrong", _set("components.unet.bytes", lambda n: n + 1), ["unet.tflite", "size check"]),
    Case("input-dtype-not-the-file", _set("components.text_encoder.inputs[0].dtype", "int64"),
         ["text_encoder.tflite", "input_ids", "int32", "int64", "signature check"]),
    Case("time-table-narrower-than-declared", _narrow_time_table, ["time_embedding.npy", "[1000, 8]", "[1000, 16]", "shape check"]),
]


def _copy(valid: Path, root: Path, case: Case) -> Path:
    b = root / case.id
    shutil.copytree(valid, b)
    man = json.loads((b / "manifest.json").read_text())
    case.edit(b, man)
    (b / "manifest.json").write_text(json.dumps(man))
    return b


def test_the_intact_bundle_passes(valid_bundle):
    man = check_bundle(valid_bundle)
    assert manifest_problems(valid_bundle, man) == []


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_run_bundle_refuses_before_running(case: Case, valid_bundle, tmp_path, capsys):
    b = _copy(valid_bundle, tmp_path, case)
    out = tmp_path / "out"
    capsys.readouterr()
    code = main(["run-bundle", str(b), "--prompt", "a red circle", "--output", str(out), "--accelerator", "cpu"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: bundle "), err
    for culprit in case.culprits:
        assert culprit in lines[0], f"{culprit!r} not named in: {lines[0]}"
    assert "Traceback" not in err
    assert not out.exists()


def test_run_bundle_refuses_a_negative_seed_naming_it(valid_bundle, tmp_path):
    """Issue 34: `--seed -1` exits 2 with one line naming --seed (it was `ValueError: expected
    non-negative integer`, exit 1), before --output is made; no native log is left in the temp
    folder. A real `python -m pocketdiff` process."""
    tmpdir, out = tmp_path / "tmp", tmp_path / "out"
    tmpdir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir), "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-m", "pocketdiff", "run-bundle", str(valid_bundle), "--prompt", "a red circle",
                        "--output", str(out), "--accelerator", "cpu", "--seed", "-1"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == ["error: --seed must be a non-negative integer, got -1"], r.stderr
    assert not out.exists() and list(tmpdir.iterdir()) == []


def test_every_problem_is_listed(valid_bundle, tmp_path):
    """manifest_problems (verify-bundle's report) lists each problem, not only the first."""
    def two(b: Path, m: dict) -> None:
        m["scheduler"]["timesteps"][0] = 5000
        m["components"]["unet"]["bytes"] += 1

    b = _copy(valid_bundle, tmp_path, Case("two", two, []))
    from pocketdiff.runtime.bundle import load_manifest

    found = {(p.where, p.check) for p in manifest_problems(b, load_manifest(b))}
    assert found == {("scheduler.timesteps[0]", "range"), ("unet.tflite", "size")}


@pytest.mark.parametrize("spacing,offset", [("leading", 1), ("leading", 0), ("trailing", 0), ("linspace", 0)])
def test_spacing_matches_diffusers(spacing, offset):
    """The runner-side (numpy) spacing rule gives DDIMScheduler's own timesteps."""
    from diffusers import DDIMScheduler

    for steps in (1, 3, 4, 7, 20, 50):
        s = DDIMScheduler(num_train_timesteps=1000, timestep_spacing=spacing, steps_offset=offset)
        s.set_timesteps(steps)
        assert ddim_timesteps(1000, steps, spacing=spacing, steps_offset=offset) == s.timesteps.tolist(), (spacing, offset, steps)
