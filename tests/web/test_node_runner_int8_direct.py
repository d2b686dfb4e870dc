"""Issue 66 item 5, the CI part: the phone preset's int8 weights (export `int8.gpu_weights: direct`: every 1x1 conv of
the text encoder and UNet reads its int8 filter itself, no DEQUANTIZE; export/int8_direct.py) through the page's
pipeline in Node.js (web/node_runner.mjs, LiteRT.js on Dawn, lavapipe here). The block-removed smoke bundle
(tests/web/smoke_bundle_tiny: four layer-cut UNet chunks, the `tiny` preset's shape) is rewritten that way here, so
nothing more is shipped: every model fully accelerated on WebGPU at fp32 (LiteRT.js's default) and fp16 (the page's
half precision), and the image within 40 dB of run-bundle's from the same latents. The phone preset's other parts run
in the page's tests on their own shipped bundles: chunked text encoder (test_check_chunked.py), the decoder in three
graphs (test_check_tiled_parts.py), 3x3 convs lowered to 1x1 taps (test_node_runner.py, the lowered decoder)."""
from __future__ import annotations

import json

import pytest
from node_runner_cli import dawn_or_skip, run_node_runner  # tests/node_runner_cli.py

MIN_IMAGE_PSNR_DB = 40.0
INT8 = ["text_encoder", "unet.0", "unet.1", "unet.2", "unet.3"]


@pytest.fixture(scope="module")
def direct_bundle(tmp_path_factory, assemble_tiny):
    """The tiny smoke bundle with its int8 1x1 filters fed directly, and its page (run-bundle's reference image)."""
    from pocketdiff.export.int8_direct import rewrite_bundle
    from pocketdiff.web.page import PageConfig, write_page

    root = tmp_path_factory.mktemp("int8_direct")
    bundle = root / "direct"
    counts = rewrite_bundle(assemble_tiny(root / "tiny"), bundle)
    write_page(PageConfig(bundle=str(bundle)))
    return bundle, counts


def test_every_int8_model_reads_its_filters_directly(direct_bundle):
    bundle, counts = direct_bundle
    man = json.loads((bundle / "manifest.json").read_text())
    assert sorted(counts) == sorted(INT8) and all(n > 0 for n in counts.values()), counts
    assert all(man["components"][name]["int8"]["storage"] == "direct" for name in INT8)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_node_runner_runs_the_direct_int8_bundle_and_matches_run_bundle(node, direct_bundle, precision, tmp_path):
    bundle, _ = direct_bundle
    out = tmp_path / "report.json"
    # resident: each model compiled once; the image against run-bundle's reference stands for the goldens here
    p = run_node_runner(dawn_or_skip(node), str(bundle), "--no-goldens", "--precision", precision, "--out", str(out),
                        timeout=600, skip_without_adapter=True)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["ok"] and r["failures"] == [] and r["precision"] == precision
    assert list(r["components"]) == [*INT8, "vae_decoder"]
    for name, c in r["components"].items():
        assert c["accelerator"] == "webgpu" and c["fully_accelerated"], name
    assert r["image"]["finite"] and r["image"]["psnr_db"] >= MIN_IMAGE_PSNR_DB, r["image"]
