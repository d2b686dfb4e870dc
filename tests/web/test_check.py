"""The page in headless Chromium (WebGPU on SwiftShader here): check mode on the shipped smoke
bundle, a tampered file, and the wasm CPU path. Skips only when Chromium is absent."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pocketdiff.web.headless import check_page
from pocketdiff.web.page import PageConfig, write_page

SMOKE_BUNDLE = Path(__file__).resolve().parent / "smoke_bundle"


@pytest.fixture(scope="module")
def checked(tmp_path_factory, chromium):
    import shutil

    root = tmp_path_factory.mktemp("web")
    bundle = root / "bundle"
    shutil.copytree(SMOKE_BUNDLE, bundle, ignore=shutil.ignore_patterns("README.md", "web"))
    write_page(PageConfig(bundle=str(bundle)))
    ref = json.loads((bundle / "web/reference/reference.json").read_text())
    result = check_page(bundle, prompt=ref["prompt"], seed=ref["seed"], timeout_s=600, screenshot=root / "page.png", executable=chromium)
    return {"bundle": bundle, "result": result, "manifest": json.loads((bundle / "manifest.json").read_text())}


def test_check_mode_every_component_fully_accelerated_and_within_tolerance(checked):
    r = checked["result"]
    assert r["ok"] is True, r["failures"]
    assert r["accelerator"] == "webgpu" and r["webgpu"]["available"]
    assert set(r["components"]) == {"text_encoder", "unet", "vae_decoder"}
    for name, c in r["components"].items():
        assert c["accelerator"] == "webgpu" and c["fully_accelerated"] is True, name
        g = c["golden"]
        tol = checked["manifest"]["components"][name]["golden"]["tolerances"][g["precision"]]
        assert g["pass"] and g["cosine"] >= tol["cosine_min"] and g["psnr_db"] >= tol["psnr_min_db"], (name, g)
    assert r["tokenizer"]["golden_ids_match"] is True
    assert r["latents"] == "reference/latents.bin"


def test_page_image_matches_run_bundle_from_the_same_latents(checked):
    img = checked["result"]["image"]
    assert img["finite"] and img["reference"] == "reference/image.bin"
    assert img["psnr_db"] >= 30.0
    lat = checked["result"]["latency_ms"]
    assert len(lat["unet_steps_ms"]) == len(checked["manifest"]["scheduler"]["timesteps"])


def test_screenshot(checked):
    shot = checked["result"]["screenshot"]
    with open(shot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_page_refuses_a_file_whose_sha256_differs(checked, chromium):
    bundle = checked["bundle"]
    tok = bundle / "tokenizer" / "tokenizer.json"
    original = tok.read_bytes()
    tok.write_bytes(original + b" ")
    try:
        # the page's own check, as behind any static server (`pocketdiff serve` itself refuses such a file with 409:
        # tests/web/test_serve_hostile.py)
        r = check_page(bundle, timeout_s=300, executable=chromium, verify_files=False)
    finally:
        tok.write_bytes(original)
    assert r["ok"] is False
    assert "sha256 mismatch for tokenizer/tokenizer.json" in r["error"]


def test_wasm_cpu_path(checked, chromium):
    ref = json.loads((checked["bundle"] / "web/reference/reference.json").read_text())
    r = check_page(checked["bundle"], prompt=ref["prompt"], seed=ref["seed"], timeout_s=600, executable=chromium, accelerator="wasm")
    assert r["accelerator"] == "wasm"
    assert r["ok"] is False and any("not WebGPU" in f for f in r["failures"])  # the GPU is what the check is for
    for name, c in r["components"].items():
        assert c["accelerator"] == "wasm" and c["golden"]["precision"] == "fp32"
        assert c["golden"]["cosine"] >= 0.9999, name
    assert r["image"]["psnr_db"] >= 30.0


def test_browser_without_webgpu_gets_the_wasm_path_and_long_prompts_are_truncated(checked, chromium):
    prompt = " ".join(["a big purple hexagon on a gray background"] * 12)
    r = check_page(checked["bundle"], prompt=prompt, seed=1, timeout_s=600, executable=chromium,
                   webgpu=False)  # Chromium without --enable-unsafe-webgpu: no adapter on a machine without a GPU
    assert r["webgpu"]["available"] is False and r["webgpu"]["reason"]
    assert r["accelerator"] == "wasm" and r["ok"] is False
    assert all(c["accelerator"] == "wasm" for c in r["components"].values())
    assert r["image"]["finite"] and "skipped" in r["image"]  # no reference for this prompt / seed
    assert r["latents"].startswith("page noise")
    assert r["tokenizer"]["truncated"] == r["tokenizer"]["tokens"] - 75 > 0
    notes = " ".join(r["notes"])
    assert "No WebGPU here" in notes and "CPU (wasm)" in notes
    assert f"the last {r['tokenizer']['truncated']} were dropped" in notes


def test_second_prompt_reuses_the_resident_unet(checked, chromium):
    import time

    from pocketdiff.web.headless import Chromium
    from pocketdiff.web.serve import PageServer

    with PageServer(checked["bundle"], port=0) as srv, Chromium(chromium) as chrome:
        chrome.navigate(srv.url + "?accelerator=wasm")
        images = []
        for prompt in ("a red circle", "a blue square"):
            deadline = time.monotonic() + 120
            while chrome.evaluate("document.getElementById('generate').disabled") is not False:
                assert time.monotonic() < deadline, chrome.console[-5:]
                time.sleep(0.2)
            chrome.evaluate(f"document.getElementById('status').textContent = ''; document.getElementById('prompt').value = {prompt!r}; "
                            "document.getElementById('generate').click()")
            while not str(chrome.evaluate("document.getElementById('status').textContent")).startswith(("done", "error")):
                assert time.monotonic() < deadline, chrome.console[-5:]
                time.sleep(0.2)
            assert chrome.evaluate("document.getElementById('status').textContent").startswith("done")
            row = chrome.evaluate("document.querySelector('tr[data-stage=unet]').textContent")
            images.append(chrome.evaluate("document.getElementById('image').toDataURL()"))
        assert "CPU (wasm)" in row
        # the second prompt's UNet row shows no fetch / compile: it stayed resident
        cells = chrome.evaluate("[...document.querySelectorAll('tr[data-stage=unet] td')].map(td => td.textContent)")
        assert cells[3] == "" and cells[4] == "" and cells[5].endswith("ms"), cells
        assert images[0] != images[1]


def test_page_refuses_a_chunk_block_whose_chunks_are_missing(checked, check_with_manifest):
    """A manifest that lists UNet chunks the bundle does not have: refused naming the missing chunk (a
    chunked bundle itself runs: tests/web/test_check_chunked.py)."""
    r = check_with_manifest(checked["bundle"],
                            lambda man: man.update(schema_version=2, unet_chunks={"components": ["unet.0", "unet.1"]}))
    assert r["ok"] is False
    assert "has no unet.0" in r["error"], r["error"]
