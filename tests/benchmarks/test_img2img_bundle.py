"""benchmarks/img2img_bundle.py on the CPU (scripts/gpu/img2img_bundle.sh's steps on the web smoke bundle): the encoder
of an encoder-only export grafted into a hard-linked copy of a bundle (the original untouched, its other stages kept),
a run-bundle --pipelined --init-image report summarized per model into the row, and the encoder alone on the delegate."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from script_module import load_script  # tests/script_module.py

SMOKE = Path(__file__).resolve().parents[1] / "web" / "smoke_bundle"


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/img2img_bundle.py", "img2img_bundle_bench")


@pytest.fixture(scope="module")
def grafted(bench, smoke_encoder_export, tmp_path_factory):
    root = tmp_path_factory.mktemp("i2i")
    shutil.copytree(SMOKE, root / "tiny", ignore=shutil.ignore_patterns("README.md", "web"))
    os.system(f"cp -al '{root / 'tiny'}' '{root / 'tiny_i2i'}'")  # as the GPU script copies the unpacked bundle
    before = (root / "tiny" / "manifest.json").read_bytes()
    block = bench.graft(root / "tiny_i2i", smoke_encoder_export)
    assert (root / "tiny" / "manifest.json").read_bytes() == before and not (root / "tiny" / "vae_encoder.tflite").exists()
    return {"root": root, "bundle": root / "tiny_i2i", "block": block}


def test_graft_adds_the_encode_stage_before_the_denoiser(grafted):
    from pocketdiff.runtime.bundle import load_manifest

    block = grafted["block"]
    assert [s["kind"] for s in block["stages"]] == ["encode_prompt", "encode_image", "denoise", "decode"]
    assert block["tasks"] == ["text_to_image", "image_to_image", "inpaint"]
    man = load_manifest(grafted["bundle"])  # the runner's checks pass
    assert man["pipeline"]["stages"][1]["inputs"] == {"pixels": "init_image"}


def test_the_row_summarizes_a_pipelined_img2img_run_per_model(bench, grafted, tmp_path):
    from pocketdiff.cli import main as cli_main

    pic = tmp_path / "pic.png"
    bench.picture(pic, 32, 32)
    reports = {}
    for name, flags in (("i2i", ["--init-image", str(pic), "--strength", "0.5"]), ("t2i", [])):
        out = tmp_path / name
        assert cli_main(["run-bundle", str(grafted["bundle"]), "--prompt", "a red circle", "--output", str(out),
                         "--accelerator", "cpu", "--pipelined", *flags]) == 0
        reports[name] = out / "report.json"
    row = bench.row(reports["i2i"], reports["t2i"], None, tmp_path / "row.json", "cpu")
    assert json.loads((tmp_path / "row.json").read_text()) == row
    per = row["img2img"]["per_model"]
    assert per["vae_encoder"]["run_s"] > 0 and per["vae_encoder"]["load_s"] > 0 and "max_host_rss_mb" in per["vae_encoder"]
    assert per["unet"]["steps_s"] > 0 and row["strength"] == 0.5
    assert "vae_encoder" not in row["text_to_image_warm"]["per_model"]  # the text run never loads it
    assert row["within_budget_at_once"] is None  # no GPU: no host + GPU figure, no verdict


def test_the_encoder_alone_on_the_delegate(bench, gpu_delegate, grafted, tmp_path):
    res = bench.encoder(grafted["bundle"] / "vae_encoder.tflite", 32, tmp_path / "enc.json")
    assert res["compiled"] and res["fully_accelerated"] and res["finite"] and res["latent_shape"] == [1, 4, 8, 8]
