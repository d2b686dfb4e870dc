"""Issue 48 item 2, the web part: a block-removed UNet (the `tiny` preset, BK-SDM-Tiny's shape: no mid block, no
lowest-resolution stage) in four layer-cut chunks (tests/web/smoke_bundle_tiny, shipped) through the page's check
mode in headless Chromium (SwiftShader) with its chunks resident, and through web/node_runner.mjs on Dawn (lavapipe)
with them streamed: every chunk fully accelerated and (in the page) within its golden, unet.0's stream passed on as up_blocks.0's
deepest skip (the manifest's alias), and the image within 40 dB of run-bundle's from the same latents."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

MIN_IMAGE_PSNR_DB = 40.0
UNET_CHUNKS = ["unet.0", "unet.1", "unet.2", "unet.3"]
ORDER = ["text_encoder", *UNET_CHUNKS, "vae_decoder"]
RUNNER = Path(__file__).resolve().parents[2] / "web" / "node_runner.mjs"


@pytest.fixture(scope="module")
def checked(tmp_path_factory, assemble_tiny, check_against_reference):
    # the page written once (run-bundle's reference image, the chunks in sequence), then its check mode, resident
    return check_against_reference(assemble_tiny(tmp_path_factory.mktemp("web_blocks") / "bundle"), MIN_IMAGE_PSNR_DB)


def test_the_bundle_has_no_mid_block_and_no_lowest_stage(checked):
    man = checked["manifest"]
    block = man["unet_chunks"]
    assert block["components"] == UNET_CHUNKS
    stages = [s for chunk in block["stages"] for s in chunk]
    assert "mid_block" not in stages and all(".layers." in s or s.endswith(".sampler") for s in stages)  # layer cuts
    assert {s.split(".layers.")[0].split(".sampler")[0] for s in stages} == {"down_blocks.0", "down_blocks.1", "up_blocks.0", "up_blocks.1"}
    assert block["aliases"][0] == {"skip_3": "hidden"}  # no mid block: the stream is up_blocks.0's deepest skip
    assert [i["name"] for i in man["components"]["unet.1"]["inputs"]][:2] == ["hidden", "skip_3"]


def test_page_runs_the_block_removed_bundle_and_matches_run_bundle(checked):
    r = checked["result"]
    assert r["ok"] is True, r.get("failures") or r.get("error")
    assert r["accelerator"] == "webgpu" and r["unet"] == "resident"
    assert list(r["components"]) == ORDER
    for name, c in r["components"].items():
        assert c["accelerator"] == "webgpu" and c["fully_accelerated"] is True, name
        assert "skipped" not in c["golden"] and c["golden"]["pass"] is True, (name, c["golden"])
    assert len(r["latency_ms"]["unet_steps_ms"]) == checked["manifest"]["scheduler"]["steps"]
    img = r["image"]
    assert img["min_psnr_db"] == MIN_IMAGE_PSNR_DB and img["finite"] and img["psnr_db"] >= MIN_IMAGE_PSNR_DB, img


def test_node_runner_streams_the_block_removed_chunks_and_matches_run_bundle(checked, node, tmp_path):
    if not (RUNNER.parent / "node_modules" / "webgpu" / "package.json").is_file():
        pytest.skip("npm webgpu is not in web/node_modules (bash scripts/setup.sh installs it)")
    from pocketdiff.runtime.delegate import delegate_env

    env, _ = delegate_env()
    out = tmp_path / "report.json"
    # the goldens were checked by the page above; here the chunks run only in the image's steps
    p = subprocess.run([node, str(RUNNER), str(checked["bundle"]), "--unet", "streamed", "--no-goldens", "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=900)
    if p.returncode == 2 and "no WebGPU adapter" in p.stderr:
        pytest.skip("Dawn found no Vulkan device here (scripts/setup_vulkan.sh unpacks lavapipe)")
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["ok"] and r["failures"] == [] and r["unet"] == "streamed"
    assert list(r["components"]) == ORDER
    for name, c in r["components"].items():
        assert c["accelerator"] == "webgpu" and c["fully_accelerated"], name
    assert r["image"]["psnr_db"] >= MIN_IMAGE_PSNR_DB, r["image"]  # the page's reference/, run-bundle's image
    assert r["gpu_memory"]["live_mb"] == 0  # each streamed chunk's device destroyed on release
    devices = [d["models"] for d in r["gpu_memory"]["per_device"]]
    assert all(devices.count([name]) == r["steps"] + 1 for name in UNET_CHUNKS), devices  # its first compile, then each step
