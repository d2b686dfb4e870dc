"""The page's code on an SDXL UNet in chunks (issue 63; tests/conftest.py `sdxl_chunked_bundles`: the tiny SDXL folder
with its UNet in 2 block-cut and 3 layer-cut chunks). unet.0 takes `text_embeds` and `time_ids` and returns `emb`, which
later chunks read in place of `timestep`: web/static/stages.js derives and checks the same pipeline as
runtime/pipeline_spec.py (the chunks block's inputs fed by role), web/static/chunks.js passes `emb` by name (and names it
when no chunk makes it), and the Node runner (web/node_runner.mjs, Dawn over lavapipe) gives run-bundle's image."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from node_runner_cli import dawn_or_skip, run_node_runner  # tests/node_runner_cli.py
from tiny_sdxl import SDXL_CHUNKINGS  # tests/tiny_sdxl.py

from pocketdiff.runtime.manifest_check import manifest_problems
from pocketdiff.runtime.pipeline_spec import derive_pipeline, pipeline_of

HERE = Path(__file__).resolve().parent
STATIC = HERE.parents[1] / "web" / "static"


def _node(node: str, tmp_path: Path, harness: str, request: dict, *before: str) -> dict:
    req = tmp_path / "request.json"
    req.write_text(json.dumps(request))
    res = subprocess.run([node, str(HERE / harness), *before, str(req)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)


def test_stages_js_derives_and_checks_the_chunked_sdxl_pipeline_as_python(node, sdxl_chunked_bundles, tmp_path):
    ks = [max(SDXL_CHUNKINGS)]  # the layer-cut bundle the Node runner test below runs (one export on this worker)
    mans = [json.loads((sdxl_chunked_bundles[k] / "manifest.json").read_text()) for k in ks]
    out = _node(node, tmp_path, "stages_harness.mjs", {"manifests": mans})["manifests"]
    for k, man, got in zip(ks, mans, out):
        assert got["pipeline"] == pipeline_of(man) and got["derived"] == derive_pipeline(man)
        assert got["problems"] == [] and got["error"] is None and manifest_problems("unused", man, files=False) == []
        denoise = got["pipeline"]["stages"][2]
        assert denoise["inputs"]["text_embeds"] == "pooled_embeds" and denoise["inputs"]["time_ids"] == "time_ids"
        assert got["parts"][2] == [f"unet.{i}" for i in range(k)]


UNET_BLOCK = {"schema_version": 2, "unet_chunks": {"components": ["unet.0", "unet.1"]}}
FEEDS = {"sample": 1, "timestep": 2, "text_embeds": 3, "time_ids": 4}  # the whole UNet's inputs, by role


@pytest.mark.parametrize("first_outputs, expect", [
    (["hidden", "emb"], 24.0),  # unet.0: 1 + 2 + 3 + 4 = 10 -> hidden 11, emb 12; unet.1: 11 + 12 + 1
    (["hidden"], "unet.1: no earlier chunk (nor the UNet's inputs) makes its input emb (the time embedding plus the added "
                 "embedding of text_embeds and time_ids, which the first chunk computes and returns)"),
])
def test_chunks_js_passes_the_summed_embedding_by_name(node, tmp_path, first_outputs, expect):
    chain = {"manifest": UNET_BLOCK, "feeds": FEEDS,
             "parts": [{"name": "unet.0", "inputs": ["sample", "timestep", "text_embeds", "time_ids"], "outputs": first_outputs},
                       {"name": "unet.1", "inputs": ["hidden", "emb"], "outputs": ["out"]}]}
    request = {"tokenizer_json": str(STATIC.parents[1] / "pocketdiff/assets/shapes-teacher/tokenizer/tokenizer.json"),
               "tokenizer": {"max_length": 77, "pad_id": 593, "bos_id": 592, "eos_id": 593}, "prompts": [],
               "files": [], "npy": [], "npz": [], "chunk_chain": chain}
    got = _node(node, tmp_path, "js_harness.mjs", request, str(STATIC))["chunk_chain"]
    if isinstance(expect, float):
        assert got.get("value") == expect, got
    else:
        assert expect in got.get("error", ""), got


def test_the_node_runner_on_the_chunked_sdxl_bundle_matches_run_bundle(node, sdxl_chunked_bundles, tmp_path):
    from pocketdiff.web.page import PageConfig, write_page

    dawn = dawn_or_skip(node)
    k = max(SDXL_CHUNKINGS)
    bundle = tmp_path / "bundle"  # the session's bundle stays as exported: the page is written into a copy
    shutil.copytree(sdxl_chunked_bundles[k], bundle)
    write_page(PageConfig(bundle=str(bundle)))  # web/reference/: run-bundle's image from the same latents
    out = tmp_path / "report.json"
    p = run_node_runner(dawn, str(bundle), "--out", str(out), skip_without_adapter=True)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["failures"] == [], report["failures"]
    assert set(report["components"]) == {"text_encoder", "text_encoder_2", *(f"unet.{i}" for i in range(k)), "vae_decoder"}
    for name, c in report["components"].items():
        assert c["accelerator"] == "webgpu" and c["fully_accelerated"], name
        assert c["golden"]["pass"], (name, c["golden"])  # unet.0's every output: the stream, skips and emb
    assert report["image"]["psnr_db"] >= 40, report["image"]  # as the whole SDXL UNet's (test_node_runner_sdxl.py)
