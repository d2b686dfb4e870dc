"""A LoRA swapped into the bundle in the Node runner (`--lora FILE --lora-scale S`) and the page (`?lora=URL&lora_scale=S`),
against run-bundle's image with the same LoRA (`pocketdiff web`'s PageConfig lora / lora_scale makes the reference). The
bundle: the web smoke bundle with a UNet exported here with LoRA slots (`components: [unet]`, the smoke recipe's int8
RTN UNet plus `lora_slots: {rank: 4, targets: [attn]}`) grafted in, as tests/web/test_check_img2img.py grafts an encoder
(one export per module). The LoRA: diffusers / PEFT keys of rank 2 (zero-padded to the slots' 4) on every slot, drawn
from the slots' shapes. Refusals: one line, exit 2, before anything compiles."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from node_runner_cli import dawn_or_skip, run_node_runner  # tests/node_runner_cli.py

SMOKE = Path(__file__).resolve().parent / "smoke_bundle"
SCALE = 0.8


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


@pytest.fixture(scope="module")
def unet_export(tmp_path_factory) -> Path:
    """The smoke recipe's UNet alone, with slots (the delegate check left to the runners: the Node runner requires every
    component fully accelerated on Dawn; test_lora_slots.py covers the export's own)."""
    from pocketdiff.cli import main as cli_main

    root = tmp_path_factory.mktemp("lora_web")
    cfg = {"seed": 0, "model": {"pretrained": "pocketdiff:shapes-teacher"}, "components": ["unet"], "weights": "int8",
           "int8": {"rtn": True}, "guidance": "cfg", "guidance_scale": 3.0, "steps": 4,
           "golden_prompt": "a large red circle at the center", "lora_slots": {"rank": 4, "targets": ["attn"]},
           "verify": {"delegate": False}, "fp16_scan": {"enabled": False}}
    (root / "export.yaml").write_text(yaml.safe_dump(cfg))
    assert cli_main(["export", "--config", str(root / "export.yaml"), "--output", str(root / "unet")]) == 0
    return root / "unet"


def graft_unet(bundle: Path, unet_export: Path) -> None:
    """The slotted UNet (same teacher, recipe and time embedding) in place of `bundle`'s, its slots and roles declared."""
    from pocketdiff.runtime.pipeline_spec import PIPELINE_SCHEMA_VERSION, derive_pipeline

    man = json.loads((bundle / "manifest.json").read_text())
    exp = json.loads((unet_export / "manifest.json").read_text())
    assert exp["time_embedding"]["sha256"] == man["time_embedding"]["sha256"]  # the same table: the graft is consistent
    unet = exp["components"]["unet"]
    for rel in (unet["path"], unet["golden"]["path"]):
        shutil.copy(unet_export / rel, bundle / rel)
    man["components"]["unet"], man["lora_slots"] = unet, exp["lora_slots"]
    man["schema_version"] = PIPELINE_SCHEMA_VERSION
    man["pipeline"] = derive_pipeline(man)
    (bundle / "manifest.json").write_text(json.dumps(man, indent=1))


def lora_file(path: Path, man: dict, rank: int = 2, seed: int = 1, widen: bool = False) -> Path:
    """A PEFT LoRA on every slot of `man` (alpha 4 in its metadata: x2); `widen`: the first slot's down factor one
    column too wide (a LoRA for another base)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    shapes = {i["name"]: i["shape"] for i in man["components"]["unet"]["inputs"]}
    state = {}
    for k, (module, (down, up)) in enumerate(man["lora_slots"]["inputs"].items()):
        n_in, n_out = shapes[down][0] + (1 if widen and k == 0 else 0), shapes[up][1]
        state[f"unet.{module}.lora_A.weight"] = (rng.standard_normal((rank, n_in)) / n_in ** 0.5).astype(np.float32)
        state[f"unet.{module}.lora_B.weight"] = (0.3 * rng.standard_normal((n_out, rank))).astype(np.float32)
    save_file(state, str(path), metadata={"lora_adapter_metadata": json.dumps({"unet.lora_alpha": 2 * rank, "unet.r": rank})})
    return path


@pytest.fixture(scope="module")
def slotted(tmp_path_factory, unet_export) -> dict:
    """The grafted bundle with its page and run-bundle's reference made with the LoRA at SCALE, and the LoRA."""
    from pocketdiff.web.page import PageConfig, write_page

    root = tmp_path_factory.mktemp("lora_bundle")
    bundle = root / "bundle"
    shutil.copytree(SMOKE, bundle, ignore=shutil.ignore_patterns("README.md", "web"))
    graft_unet(bundle, unet_export)
    man = json.loads((bundle / "manifest.json").read_text())
    lora = lora_file(root / "style.safetensors", man)
    lora_file(root / "other_base.safetensors", man, widen=True)
    write_page(PageConfig(bundle=str(bundle), lora=str(lora), lora_scale=SCALE))
    return {"bundle": bundle, "lora": lora, "other": root / "other_base.safetensors"}


def test_the_reference_is_made_with_the_lora_and_it_changes_the_image(slotted):
    """Not vacuous: run-bundle's image with the LoRA (the page's reference) is far from its image without it."""
    from pocketdiff.runtime.run_bundle import BundleRunner

    bundle = slotted["bundle"]
    ref = json.loads((bundle / "web/reference/reference.json").read_text())
    assert ref["lora"] == "lora.safetensors" and ref["lora_scale"] == SCALE
    assert (bundle / "web/reference/lora.safetensors").read_bytes() == slotted["lora"].read_bytes()
    assert (bundle / "web/lora_ui.js").is_file()
    shape = tuple(ref["image_shape"])
    with_lora = np.fromfile(bundle / "web/reference/image.bin", np.float32).reshape(shape)
    latents = np.fromfile(bundle / "web/reference/latents.bin", np.float32).reshape(ref["latents_shape"])
    with BundleRunner(bundle, "cpu", gpu_cache=False) as runner:
        plain, _ = runner.run(ref["prompt"], seed=ref["seed"], init_latents=latents)
    assert psnr(plain, with_lora) < 30, "the LoRA barely changes the image: the comparisons below would prove little"


def test_node_runner_with_the_lora_matches_run_bundle(slotted, node, tmp_path):
    """>= 40 dB against run-bundle's CPU image with the same LoRA and scale (fp32 WebGPU on Dawn vs numpy-fed CPU
    LiteRT: both > 100 dB apart in tests/export/test_lora_slots.py's GPU fp32 runs), every golden passing (the UNet's
    golden carries seeded factors) and every component fully accelerated."""
    node = dawn_or_skip(node)
    bundle = slotted["bundle"]
    p = run_node_runner(node, str(bundle), "--lora", str(slotted["lora"]), "--lora-scale", str(SCALE), "--min-image-psnr", "40",
                        "--out", str(tmp_path / "report.json"), skip_without_adapter=True)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads((tmp_path / "report.json").read_text())
    assert r["ok"] is True and r["image"]["psnr_db"] >= 40, r["image"]
    assert r["lora"] == {"file": str(slotted["lora"]), "scale": SCALE}
    unet = r["components"]["unet"]
    assert unet["fully_accelerated"] and unet["golden"]["pass"], unet


def test_node_runner_without_the_lora_is_not_compared_with_a_lora_reference(slotted, node, tmp_path):
    node = dawn_or_skip(node)
    p = run_node_runner(node, str(slotted["bundle"]), "--no-goldens", "--out", str(tmp_path / "report.json"), skip_without_adapter=True)
    assert p.returncode == 0, p.stderr[-3000:]
    image = json.loads((tmp_path / "report.json").read_text())["image"]
    assert "psnr_db" not in image and "no LoRA" in image["skipped"], image


@pytest.mark.parametrize("case,needle", [
    ("scale_alone", "--lora-scale 0.5: scales a LoRA"),
    ("pickle", "a pickle (.ckpt)"),
    ("missing", "no such file"),
    ("corrupt", "not a valid safetensors file"),
    ("other_base", "does not fit the slot of unet."),
    ("no_slots", "the bundle has no LoRA slots"),
])
def test_node_runner_refuses_bad_lora_input_in_one_line_before_compiling(slotted, node, tmp_path, case, needle):
    node = dawn_or_skip(node)
    bundle, lora = str(slotted["bundle"]), str(slotted["lora"])
    (tmp_path / "x.ckpt").write_bytes(b"\x80\x04not opened")
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": trunc")
    args = {"scale_alone": [bundle, "--lora-scale", "0.5"], "pickle": [bundle, "--lora", str(tmp_path / "x.ckpt")],
            "missing": [bundle, "--lora", str(tmp_path / "none.safetensors")],
            "corrupt": [bundle, "--lora", str(tmp_path / "bad.safetensors")],
            "other_base": [bundle, "--lora", str(slotted["other"])],
            "no_slots": [str(SMOKE), "--lora", lora]}[case]
    p = run_node_runner(node, *args, "--out", str(tmp_path / "report.json"), skip_without_adapter=True)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [line for line in p.stderr.splitlines() if line.startswith("node_runner:")]  # LiteRT's INFO lines aside
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("node_runner: --lora"), p.stderr[-2000:]
    assert "compiled in" not in p.stderr and not (tmp_path / "report.json").exists()  # nothing compiled, nothing written


def test_page_refuses_a_lora_scale_alone(tmp_path):
    from pocketdiff.errors import PocketdiffError
    from pocketdiff.web.page import PageConfig

    with pytest.raises(PocketdiffError, match="--lora-scale"):
        PageConfig(bundle=str(SMOKE), lora_scale=0.5)


def test_page_check_mode_with_the_lora_matches_run_bundle(slotted, chromium):
    """The page in headless Chromium (WebGPU, fp32) fed ?lora=reference/lora.safetensors&lora_scale=S: >= 40 dB."""
    from pocketdiff.web.headless import check_page

    ref = json.loads((slotted["bundle"] / "web/reference/reference.json").read_text())
    r = check_page(slotted["bundle"], prompt=ref["prompt"], seed=ref["seed"], timeout_s=600, executable=chromium, min_image_psnr=40,
                   lora=f"reference/{ref['lora']}", lora_scale=ref["lora_scale"])
    assert r["ok"] is True, r.get("failures") or r.get("error")
    assert r["image"]["psnr_db"] >= 40 and r["lora"]["scale"] == SCALE, r["image"]
