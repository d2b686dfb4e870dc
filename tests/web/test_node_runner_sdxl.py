"""The page's pipeline (web/node_runner.mjs, on Dawn over lavapipe) on the tiny SDXL bundle (tests/conftest.py
`sdxl_bundle`: two encode stages with tokenizer_2, pooled embeddings and time ids fed by role, zero unconditional
rows from the folder's force_zeros_for_empty_prompt): its image against run-bundle's from the same latents
(web/reference/, written by `pocketdiff web`), every component's golden, and the second tokenizer's files among
those `pocketdiff serve` sends."""
from __future__ import annotations

import json
import shutil

import pytest
from node_runner_cli import dawn_or_skip, run_node_runner  # tests/node_runner_cli.py


@pytest.fixture(scope="module")
def dawn(node) -> str:
    return dawn_or_skip(node)


def test_the_node_runner_on_the_sdxl_bundle_matches_run_bundle(dawn, sdxl_bundle, tmp_path):
    from pocketdiff.web.page import PageConfig, write_page
    from pocketdiff.web.serve_files import BundleFiles

    bundle = tmp_path / "bundle"  # the session's bundle stays as exported: the page is written into a copy
    shutil.copytree(sdxl_bundle["out"], bundle)
    man = json.loads((bundle / "manifest.json").read_text())
    assert man["pipeline"]["conditioning"]["zero_unconditional"] is True
    served = BundleFiles(bundle)
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        f, _ = served.open(f"tokenizer_2/{name}")  # checked against the manifest's sha256 and sent
        f.close()
    write_page(PageConfig(bundle=str(bundle)))  # web/reference/: run-bundle's image from the same latents
    out = tmp_path / "report.json"
    p = run_node_runner(dawn, str(bundle), "--out", str(out), skip_without_adapter=True)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["failures"] == [], report["failures"]
    assert report["tokenizer"]["golden_ids_match"] is True
    assert set(report["components"]) == {"text_encoder", "text_encoder_2", "unet", "vae_decoder"}
    for name, c in report["components"].items():
        assert c["accelerator"] == "webgpu" and c["fully_accelerated"], name
        assert c["golden"]["pass"], (name, c["golden"])
    assert report["image"]["psnr_db"] >= 40, report["image"]  # the same latents as run-bundle's reference, fp16 on the GPU
