"""The page's picture and mask readers (web/static/png.js, image_input.js) under node against PIL, which run-bundle reads
them with (runtime/image_tasks.py): every PNG colour type to RGB and to grey, PIL's Lanczos resize (same aspect ratio),
the mask on the latent grid, and the refusals (another aspect ratio, a mask of another size, not a PNG)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

STATIC = Path(__file__).resolve().parents[2] / "web" / "static"
HARNESS = Path(__file__).resolve().parent / "img2img_harness.mjs"


def _run(node: str, tmp_path: Path, cases: list[dict]) -> list[dict]:
    req = tmp_path / "request.json"
    req.write_text(json.dumps({"cases": cases}))
    res = subprocess.run([node, str(HARNESS), str(STATIC), str(req)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def pngs(tmp_path_factory) -> dict[str, Path]:
    """One picture (smooth and noisy parts, so a resize has work) saved in every PNG colour type PIL writes."""
    from PIL import Image

    d = tmp_path_factory.mktemp("pngs")
    rng = np.random.default_rng(3)
    rgb = np.clip(np.kron(rng.uniform(0, 255, (6, 6, 3)), np.ones((8, 8, 1))) + rng.normal(0, 20, (48, 48, 3)), 0, 255).astype(np.uint8)
    base = Image.fromarray(rgb)
    alpha = Image.fromarray(rng.integers(0, 256, (48, 48), dtype=np.uint8))
    rgba = base.copy()
    rgba.putalpha(alpha)
    out = {"RGB": base, "RGBA": rgba, "L": base.convert("L"), "LA": base.convert("LA"), "P": base.quantize(37),
           "1": base.convert("1"), "P4": base.convert("L").quantize(12)}
    paths = {}
    for name, im in out.items():
        paths[name] = d / f"{name}.png"
        im.save(paths[name], **({"bits": 4} if name == "P4" else {}))
    paths["wide"] = d / "wide.png"
    base.crop((0, 0, 48, 32)).save(paths["wide"])
    paths["text"] = d / "text.png"
    paths["text"].write_text("not a picture")
    return paths


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA", "P", "1", "P4"])
def test_png_reader_gives_pils_rgb_and_grey(node, pngs, tmp_path, mode):
    from PIL import Image

    rgb_case = {"png": str(pngs[mode]), "ch": 3, "width": 48, "height": 48}
    got = _run(node, tmp_path, [rgb_case, {**rgb_case, "ch": 1}])
    with Image.open(pngs[mode]) as im:
        want_rgb, want_l = np.asarray(im.convert("RGB")).ravel(), np.asarray(im.convert("L")).ravel()
    assert got[0]["warning"] is None
    np.testing.assert_array_equal(np.array(got[0]["values"]), want_rgb)  # integers: the same bytes
    np.testing.assert_array_equal(np.array(got[1]["values"]), want_l)
    assert got[0]["tensor_sum"] == pytest.approx(want_rgb.astype(np.float64).sum() / 255, rel=1e-5)


@pytest.mark.parametrize("size", [(32, 32), (24, 24), (64, 64)])
def test_resize_is_pils_lanczos(node, pngs, tmp_path, size):
    """Down and up: at most 1 (of 255) off PIL's bytes (its taps' sin() from another libm may round a sum the other
    way), and nearly all equal."""
    from PIL import Image

    got = _run(node, tmp_path, [{"png": str(pngs["RGB"]), "ch": 3, "width": size[0], "height": size[1]}])[0]
    with Image.open(pngs["RGB"]) as im:
        want = np.asarray(im.convert("RGB").resize(size, Image.LANCZOS)).ravel().astype(int)
    diff = np.abs(np.array(got["values"]) - want)
    assert diff.max() <= 1 and (diff == 0).mean() > 0.99, (diff.max(), (diff == 0).mean())
    assert got["warning"] == f"warning: init_image is 48x48 px; resized to the bundle's {size[0]}x{size[1]}"


def test_mask_on_the_latent_grid_is_run_bundles(node, pngs, tmp_path):
    from PIL import Image

    from pocketdiff.runtime.image_tasks import load_mask

    man = {"image": {"width": 32, "height": 32}, "latent": {"vae_factor": 4}}
    got = _run(node, tmp_path, [{"png": str(pngs["L"]), "width": 32, "height": 32, "mask_of": [48, 48]}])[0]
    want = load_mask(str(pngs["L"]), man, (48, 48), "pic.png")
    assert 0 < want.mean() < 1  # both values occur
    np.testing.assert_array_equal(np.array(got["latent_mask"], np.float32).reshape(want.shape), want)
    with Image.open(pngs["L"]) as im:
        assert np.abs(np.array(got["values"]) - np.asarray(im.resize((32, 32), Image.LANCZOS)).ravel()).max() <= 1


def test_refusals_name_the_input(node, pngs, tmp_path):
    got = _run(node, tmp_path, [
        {"png": str(pngs["wide"]), "ch": 3, "width": 32, "height": 32},
        {"png": str(pngs["L"]), "width": 32, "height": 32, "mask_of": [64, 64]},
        {"png": str(pngs["text"]), "ch": 3, "width": 32, "height": 32},
    ])
    assert "48x32 px has another aspect ratio than the bundle's 32x32" in got[0]["error"]
    assert "mask: 48x48 px, but the picture is 64x64" in got[1]["error"]
    assert "not a PNG" in got[2]["error"]
    assert all(g["error"].startswith("BundleError") for g in got)
