"""Shared fixtures of the web tests: the shipped smoke bundles (tests/web/smoke_bundle and its twins
smoke_bundle_tiled, one-pass tiled decoder, smoke_bundle_tiled_stats, tiled decoder with iterated norm
statistics, smoke_bundle_tiled_parts, one-pass with the up path in two graphs, smoke_bundle_lowered_decoder, the decoder's 3x3
convs lowered to 1x1 taps, smoke_bundle_chunked, UNet and text encoder each in two chunks, and smoke_bundle_tiny, a block-removed
UNet (no mid block, no lowest stage) in four layer-cut chunks; made by `pocketdiff export`, see their READMEs)
copied to a temporary folder, node and Chromium."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from node_runner_cli import edited_manifest  # tests/node_runner_cli.py

HERE = Path(__file__).resolve().parent
SMOKE_BUNDLE = HERE / "smoke_bundle"
TILED_SMOKE_BUNDLE = HERE / "smoke_bundle_tiled"
CHUNKED_SMOKE_BUNDLE = HERE / "smoke_bundle_chunked"
TILED_STATS_SMOKE_BUNDLE = HERE / "smoke_bundle_tiled_stats"
TINY_SMOKE_BUNDLE = HERE / "smoke_bundle_tiny"
TILED_PARTS_SMOKE_BUNDLE = HERE / "smoke_bundle_tiled_parts"
LOWERED_DECODER_SMOKE_BUNDLE = HERE / "smoke_bundle_lowered_decoder"


@pytest.fixture
def smoke_bundle(tmp_path) -> Path:
    """A writable copy of the shipped smoke bundle (the page is written into BUNDLE/web)."""
    dst = tmp_path / "bundle"
    shutil.copytree(SMOKE_BUNDLE, dst, ignore=shutil.ignore_patterns("README.md", "web"))
    return dst


def assemble_twin_bundle(twin: Path, dst: Path) -> Path:
    """A twin smoke bundle (`twin`: smoke_bundle_tiled or smoke_bundle_chunked) in `dst`: its manifest's
    files (the runtime's list of the files a manifest names; benchmarks/runner_images.py assembles the same way) from
    `twin` where they are there, else from smoke_bundle (the files they share are kept once)."""
    import json

    from pocketdiff.runtime.bundle import _file_entries

    man = json.loads((twin / "manifest.json").read_text())
    for rel in ["manifest.json", "config.yaml", *(e["path"] for e, _, _ in _file_entries(man, None))]:
        src = twin / rel if (twin / rel).is_file() else SMOKE_BUNDLE / rel
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst / rel)
    return dst


def assemble_tiled_smoke_bundle(dst: Path) -> Path:
    """The one-pass tiled smoke bundle in `dst`."""
    return assemble_twin_bundle(TILED_SMOKE_BUNDLE, dst)


@pytest.fixture(scope="session")
def assemble_tiled():
    """`assemble_tiled_smoke_bundle` for module-scoped fixtures (tests/ is not a package)."""
    return assemble_tiled_smoke_bundle


@pytest.fixture(scope="session")
def assemble_tiled_stats():
    """The iterated-statistics tiled smoke bundle (control_variate, 3 passes) assembled in a folder."""
    return lambda dst: assemble_twin_bundle(TILED_STATS_SMOKE_BUNDLE, dst)


@pytest.fixture(scope="session")
def assemble_tiled_parts():
    """The one-pass tiled smoke bundle with its up path in two graphs (vae_up_tile.0, vae_up_tile.1; export
    `vae_tiling.up_parts: 2`) assembled in a folder."""
    return lambda dst: assemble_twin_bundle(TILED_PARTS_SMOKE_BUNDLE, dst)


@pytest.fixture
def lowered_decoder_bundle(tmp_path) -> Path:
    """The smoke bundle with its decoder's 3x3 convs lowered to 1x1 taps (export `rewrites.conv_lowering=shifted_1x1
    rewrites.conv_lowering_components=[vae_decoder]`) assembled in a temporary folder."""
    return assemble_twin_bundle(LOWERED_DECODER_SMOKE_BUNDLE, tmp_path / "lowered_decoder")


@pytest.fixture(scope="session")
def assemble_chunked():
    """The chunked smoke bundle (text_encoder.0, text_encoder.1, unet.0, unet.1) assembled in a folder, for
    module-scoped fixtures."""
    return lambda dst: assemble_twin_bundle(CHUNKED_SMOKE_BUNDLE, dst)


@pytest.fixture(scope="session")
def assemble_tiny():
    """The block-removed smoke bundle (issue 48's `tiny` preset: no mid block, no lowest stage; unet.0 ... unet.3,
    layer cuts) assembled in a folder (shipped: CI exports nothing for it)."""
    return lambda dst: assemble_twin_bundle(TINY_SMOKE_BUNDLE, dst)


@pytest.fixture(scope="session")
def check_against_reference(chromium):
    """`check(bundle, min_image_psnr=None, **params)`: the page written into `bundle` with run-bundle's reference
    image (once: a bundle checked again keeps its page), then its check mode on that reference's prompt and seed
    -> {bundle, result (the page's report), reference, manifest} (min_image_psnr: the image's threshold in the
    page, None: the page's default; params: more of the page's URL parameters)."""
    import json

    from pocketdiff.web.headless import check_page
    from pocketdiff.web.page import PageConfig, write_page

    def check(bundle: Path, min_image_psnr=None, **params) -> dict:
        if not (bundle / "web/reference/reference.json").is_file():
            write_page(PageConfig(bundle=str(bundle)))
        ref = json.loads((bundle / "web/reference/reference.json").read_text())
        extra = {**params, **({} if min_image_psnr is None else {"min_image_psnr": min_image_psnr})}
        result = check_page(bundle, prompt=ref["prompt"], seed=ref["seed"], timeout_s=600, executable=chromium, **extra)
        return {"bundle": bundle, "result": result, "reference": ref,
                "manifest": json.loads((bundle / "manifest.json").read_text())}
    return check


@pytest.fixture(scope="session")
def node() -> str:
    exe = shutil.which("node")
    if exe is None:
        pytest.skip("node is not installed (the page's JS modules are tested under node; apt-get install nodejs)")
    return exe


@pytest.fixture(scope="session")
def chromium() -> str:
    from pocketdiff.web.headless import find_chromium

    exe = find_chromium()
    if exe is None:
        pytest.skip("Chromium is not installed (scripts/setup.sh installs Debian's chromium; or set POCKETDIFF_CHROMIUM)")
    return exe


@pytest.fixture(scope="session")
def check_with_manifest(chromium):
    """`check(bundle, edit)`: the page's check mode on `bundle` with its manifest changed by `edit(manifest)`
    for that one run (the file is restored after), -> the page's report."""
    from pocketdiff.web.headless import check_page

    def check(bundle: Path, edit) -> dict:
        with edited_manifest(bundle, edit):
            return check_page(bundle, timeout_s=300, executable=chromium)
    return check
