"""The one-pass tiled smoke bundle with its up path in two graphs (tests/web/smoke_bundle_tiled_parts: vae_up_tile.0,
vae_up_tile.1; issue 50) through the page's pipeline: in the Node runner (Dawn on lavapipe) and the page's check mode
in headless Chromium, every part golden-checked and the image within 40 dB of run-bundle's from the same latents; the
head is released before part 0 compiles and part 0 before part 1 compiles; a split the page cannot run is refused by
name before anything loads."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from node_runner_cli import dawn_or_skip, edited_manifest, run_node_runner  # tests/node_runner_cli.py

RUNNER = Path(__file__).resolve().parents[2] / "web" / "node_runner.mjs"
MIN_IMAGE_PSNR_DB = 40.0
HEAD, UP0, UP1 = "vae_decoder_head", "vae_up_tile.0", "vae_up_tile.1"
ORDER = ["text_encoder", "unet", HEAD, UP0, UP1]  # loaded (and reported) in this order
TILES = 4  # 2 x 2 tiles of 6 latents over the 8 x 8 latent


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, assemble_tiled_parts) -> Path:
    from pocketdiff.web.page import PageConfig, write_page

    folder = assemble_tiled_parts(tmp_path_factory.mktemp("web_tiled_parts") / "bundle")
    write_page(PageConfig(bundle=str(folder)))  # web/reference/: run-bundle's image, its up parts run as the page runs them
    return folder


@pytest.fixture(scope="module")
def dawn(node) -> str:
    return dawn_or_skip(node)


@pytest.fixture(scope="module")
def node_report(dawn, bundle, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("node_tiled_parts") / "report.json"
    p = run_node_runner(dawn, str(bundle), "--out", str(out), skip_without_adapter=True)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())


def _assert_parts_checked(report: dict) -> None:
    assert report["ok"] is True, report["failures"]
    assert list(report["components"]) == ORDER
    for name, c in report["components"].items():
        assert c["accelerator"] == "webgpu" and c["fully_accelerated"] is True, name
        assert c["golden"]["pass"] is True, (name, c["golden"])
    # each part ran once on every tile; the decode's count is tiles, not tiles x parts
    assert report["components"][UP0]["calls"] == report["components"][UP1]["calls"] == report["latency_ms"]["vae_up_tile_calls"] == TILES
    assert "calls" not in report["components"][HEAD]
    assert report["image"]["finite"] and report["image"]["psnr_db"] >= MIN_IMAGE_PSNR_DB, report["image"]


def test_node_runner_runs_the_split_up_path_and_matches_run_bundle(node_report, bundle):
    man = json.loads((bundle / "manifest.json").read_text())
    assert man["vae_tiling"]["components"] == [HEAD, UP0, UP1] and "vae_up_tile" not in man["components"]
    _assert_parts_checked(node_report)
    assert set(node_report["preflight"]) >= {HEAD, UP0, UP1}  # each part checked against the limits like any component


def test_node_runner_never_holds_two_decoder_graphs(node_report):
    seen = [(e["event"], e["model"]) for e in node_report["memory_events"]]
    for before, after in [(HEAD, UP0), (UP0, UP1)]:
        assert seen.index(("close", before)) < seen.index(("open", after)) < seen.index(("compiled", after)), seen
    decoder = [m for _, m in seen if m in (HEAD, UP0, UP1)]
    assert decoder == [HEAD] * decoder.count(HEAD) + [UP0] * decoder.count(UP0) + [UP1] * decoder.count(UP1)  # each once, in turn
    for name in (HEAD, UP0, UP1):
        assert [e for e, m in seen if m == name].count("open") == 1, name
        assert seen.index(("uploads_done", name)) < seen.index(("close", name))


def test_the_pages_check_mode_runs_the_split_up_path_at_40_db(bundle, check_against_reference):
    checked = check_against_reference(bundle, MIN_IMAGE_PSNR_DB)
    r = checked["result"]
    assert r["accelerator"] == "webgpu" and r["image"]["reference"] == "reference/image.bin"
    _assert_parts_checked(r)
    man = checked["manifest"]
    assert (r["image"]["height"], r["image"]["width"]) == (man["image"]["height"], man["image"]["width"])


def _refused(node: str, bundle: Path, edit) -> subprocess.CompletedProcess:
    """The Node runner on `bundle` with its manifest changed by `edit(manifest)` for that one run."""
    with edited_manifest(bundle, edit):
        return run_node_runner(node, str(bundle), "--no-goldens", timeout=120)


def _rename_input(man: dict) -> None:
    man["components"][UP1]["inputs"][0]["name"] = "features"


@pytest.mark.parametrize("edit, says", [
    (lambda man: man["vae_tiling"].update(scheme="control_variate", passes=3, norms=[3, 2]),
     "bundle: vae_tiling.components splits the up path in 2 parts, which only scheme one_pass runs"),
    (lambda man: man["vae_tiling"].update(components=[HEAD, UP1, UP0]), "bundle: vae_tiling.components must be "),
    (_rename_input, "bundle: vae_up_tile.1's input must be named hidden, got \"features\""),
    (lambda man: man["components"].pop(UP1), "bundle: has no vae_up_tile.1"),
])
def test_node_runner_refuses_a_split_it_cannot_run_before_loading(dawn, bundle, edit, says):
    p = _refused(dawn, bundle, edit)
    assert p.returncode == 2, p.stderr[-2000:]
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith("node_runner: " + says), line


def test_the_page_refuses_a_split_up_path_with_another_scheme_by_name(bundle, check_with_manifest):
    r = check_with_manifest(bundle, lambda man: man["vae_tiling"].update(scheme="plain", passes=2, norms=[3, 2]))
    assert r["ok"] is False
    assert "vae_tiling.components splits the up path in 2 parts, which only scheme one_pass runs" in r["error"], r["error"]
