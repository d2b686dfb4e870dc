"""`vae_tiling` in `pocketdiff export`: config checks, one tiled export of the shipped tiny teacher
(the decoder as vae_decoder_head + vae_up_tile, tiled-decode PSNR parity through the .tflite files),
its manifest block and checks, run-bundle and verify-bundle on it."""
from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
import yaml

from pocketdiff.cli import main as cli_main
from pocketdiff.errors import ConfigError, ParityError, PocketdiffError

TEACHER = "pocketdiff:shapes-teacher"
TILED = ("vae_decoder_head", "vae_up_tile")


@pytest.mark.parametrize("tiling, field", [
    ({"tile": 0}, "vae_tiling.tile"),
    ({"tile": 4, "overlap": 4}, "vae_tiling.overlap"),
    ({"tile": 4, "overlap": -1}, "vae_tiling.overlap"),
    ({"passes": 0}, "vae_tiling.passes"),
    ({"min_psnr_db": float("nan")}, "vae_tiling.min_psnr_db"),
    ({"tile": 8, "overlap": 4, "margin": 3}, "vae_tiling.margin"),
    ({"margin": -1}, "vae_tiling.margin"),
    ({"scheme": "jacobi"}, "vae_tiling.scheme"),
])
def test_config_errors_name_the_field(tiling, field):
    from pocketdiff.export.verb import VaeTilingConfig

    with pytest.raises(ConfigError, match=field):
        VaeTilingConfig(enabled=True, **tiling)


def test_tiling_needs_the_vae_decoder_component():
    from pocketdiff.export.verb import Config, VaeTilingConfig

    with pytest.raises(ConfigError, match="vae_tiling.enabled"):
        Config(components=["unet"], vae_tiling=VaeTilingConfig(enabled=True))
    assert not Config().vae_tiling.enabled  # off unless asked for


def test_tile_larger_than_the_latent_is_refused():
    import torch

    from pocketdiff.export.tiled_export import split_decoder
    from pocketdiff.export.verb import VaeTilingConfig
    from pocketdiff.models import ModelConfig, load_or_build

    vae = load_or_build(ModelConfig(pretrained=TEACHER)).vae.float().eval()
    with pytest.raises(PocketdiffError, match="vae_tiling.tile"):
        split_decoder(vae, VaeTilingConfig(enabled=True, tile=12, overlap=2), torch.zeros(1, 4, 8, 8), 4)


def test_residual_scale_is_applied_once_for_both_graphs():
    """rewrites.residual_scale (the SD-2.1 configs' fp16 range fix) scales the decoder before the
    split: the features between the graphs shrink by it, the tiled image stays the same."""
    import torch

    from pocketdiff.runtime.tiled_decode import psnr_db, tiled_decode_with_stats
    from pocketdiff.export.tiled_export import HEAD, UP_TILE, parity_latents, split_decoder
    from pocketdiff.export.verb import VaeTilingConfig
    from pocketdiff.models import ModelConfig, load_or_build

    vae = load_or_build(ModelConfig(pretrained=TEACHER)).vae.float().eval()
    lat = parity_latents(vae, 8, 4)
    tiling = VaeTilingConfig(enabled=True, tile=6, overlap=2)
    images, feats = [], []
    for scale in (None, 0.25):
        sd = split_decoder(vae, tiling, lat, 4, scale)
        head, up = sd.graphs[HEAD][0], sd.graphs[UP_TILE][0]

        def h(z):
            with torch.no_grad():
                return head(torch.from_numpy(z)).numpy()

        def u(*arrays):
            with torch.no_grad():
                return tuple(t.numpy() for t in up(*(torch.from_numpy(a) for a in arrays)))

        feats.append(h(lat.numpy()))
        images.append(tiled_decode_with_stats(lat.numpy(), h, u, 6, 2, 4, tuple(sd.block["norms"]), 5))
    np.testing.assert_allclose(feats[1], 0.25 * feats[0], rtol=1e-4, atol=1e-5)
    assert psnr_db(np.clip(images[0], 0, 1), np.clip(images[1], 0, 1)) > 60


@pytest.fixture(scope="module")
def tiled(shared_conversions, tmp_path_factory):
    """The whole tiny teacher at 32 px (8 x 8 latents), decoder tiled 6 / overlap 2 / margin 1 (2 x 2
    tiles), control-variate statistics, no delegate run here (verify-bundle below runs the two tiled
    graphs on it). Its text encoder and UNet are graphs other bundles convert too (`shared_conversions`)."""
    root = tmp_path_factory.mktemp("tiled")
    cfg = {
        "seed": 0,
        "model": {"pretrained": TEACHER},
        "weights": "fp16",
        "guidance": "cfg",
        "guidance_scale": 3.0,
        "steps": 2,
        "verify": {"delegate": False},
        "fp16_scan": {"enabled": False},
        "vae_tiling": {"enabled": True, "tile": 6, "overlap": 2, "margin": 1, "scheme": "control_variate", "passes": 5},
    }
    (root / "export.yaml").write_text(yaml.safe_dump(cfg))
    out = root / "bundle"
    with shared_conversions.of("text_encoder", "unet"):
        assert cli_main(["export", "--config", str(root / "export.yaml"), "--output", str(out)]) == 0
    return {"out": out, "report": json.loads((out / "report.json").read_text()),
            "manifest": json.loads((out / "manifest.json").read_text())}


def test_tiled_export_has_both_components_the_block_and_parity(tiled):
    man, rep = tiled["manifest"], tiled["report"]
    assert set(man["components"]) == {"text_encoder", "unet", *TILED}
    block = man["vae_tiling"]
    assert {k: block[k] for k in ("tile", "overlap", "margin", "scheme", "passes", "factor")} == {
        "tile": 6, "overlap": 2, "margin": 1, "scheme": "control_variate", "passes": 5, "factor": 4}
    K, G = block["norms"]
    up = man["components"]["vae_up_tile"]
    assert [o["shape"] for o in up["outputs"]] == [[1, 3, 24, 24], [K, 5, G]]
    assert [i["name"] for i in up["inputs"]] == ["features", "weight", "stats", "own"]
    # torch split, 5 passes: 48.1 dB (plain statistics, no margin: 38.8; one pass: 31.7)
    assert rep["vae_tiling"]["psnr_db"] >= 35.0 and block["parity_psnr_db"] == rep["vae_tiling"]["psnr_db"]
    assert rep["vae_tiling"]["up_tile_calls"] == 4 * 5
    for name in TILED:
        assert "device_profile" in rep["components"][name]
        with np.load(tiled["out"] / man["components"][name]["golden"]["path"]) as g:
            assert np.isfinite(g["output_0"]).all()
            assert ("output_1" in g.files) == (name == "vae_up_tile")


def test_manifest_check_refuses_a_tiled_manifest_missing_a_component(tiled):
    from pocketdiff.runtime.manifest_check import manifest_problems

    man = tiled["manifest"]
    assert manifest_problems(tiled["out"], man) == []
    broken = copy.deepcopy(man)
    del broken["components"]["vae_up_tile"]
    probs = manifest_problems(tiled["out"], broken, files=False)
    assert any(p.where == "components.vae_up_tile" and p.check == "present" for p in probs), probs
    no_block = copy.deepcopy(man)
    del no_block["vae_tiling"]
    probs = manifest_problems(tiled["out"], no_block, files=False)
    assert any(p.where.startswith("components.vae_") and "vae_tiling" in p.message for p in probs), probs
    bad = copy.deepcopy(man)
    bad["vae_tiling"]["tile"] = 5
    probs = manifest_problems(tiled["out"], bad, files=False)
    assert any(p.where == "components.vae_up_tile.inputs.features" for p in probs), probs
    for key, value in (("margin", 2), ("scheme", "jacobi")):  # 2 * margin > overlap 2; an unknown scheme
        bad = copy.deepcopy(man)
        bad["vae_tiling"][key] = value
        probs = manifest_problems(tiled["out"], bad, files=False)
        assert any(p.where == f"vae_tiling.{key}" for p in probs), (key, probs)


def test_run_bundle_cli_refuses_a_bundle_missing_a_tiled_component(tiled, tmp_path):
    dst = tmp_path / "b"
    shutil.copytree(tiled["out"], dst, ignore=shutil.ignore_patterns("_export"))
    man = json.loads((dst / "manifest.json").read_text())
    del man["components"]["vae_decoder_head"]
    (dst / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(PocketdiffError, match="components.vae_decoder_head"):
        from pocketdiff.runtime.manifest_check import check_bundle

        check_bundle(dst)


def test_run_bundle_decodes_tiled_as_the_numpy_driver(tiled):
    """generate() decodes through the two models (pipelined or not: the same image), and the
    runner's tiled decode equals tiled_decode_with_stats over plain LiteRT interpreters."""
    from ai_edge_litert.interpreter import Interpreter

    from pocketdiff.runtime.bundle import load_manifest
    from pocketdiff.runtime.run_bundle import generate, load_tiled_decoder, tiled_decode_bundle
    from pocketdiff.runtime.tiled_decode import tiled_decode_with_stats

    out = tiled["out"]
    image, stats = generate(out, "a red circle", seed=1, accelerator="cpu")
    assert image.shape == (32, 32, 3) and stats["finite"] and stats["vae_up_tile_calls"] == 20
    for k in ("vae_decoder_head_run", "vae_up_tiles_run", "vae_tiled_pass_mean"):
        assert stats["latency_s"][k] > 0
    piped, _ = generate(out, "a red circle", seed=1, accelerator="cpu", pipelined=True)
    np.testing.assert_array_equal(piped, image)
    assert image.std() > 0.01  # not a flat image

    man = load_manifest(out)
    block, comps = man["vae_tiling"], man["components"]
    lat = np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32)
    head, (up,) = load_tiled_decoder(comps, "cpu")
    try:
        ours, timing = tiled_decode_bundle(head, [lambda: up], block, lat)
    finally:
        head.close()
        up.close()
    runners = {n: Interpreter(model_path=comps[n]["_path"]).get_signature_runner() for n in TILED}

    def up_tile(f, w, s, own):
        o = runners["vae_up_tile"](features=f, weight=w, stats=s, own=own)
        return o["output_0"], o["output_1"]

    want = tiled_decode_with_stats(lat, lambda z: runners["vae_decoder_head"](latents=z)["output_0"], up_tile,
                                   block["tile"], block["overlap"], block["factor"], tuple(block["norms"]), block["passes"],
                                   margin=block["margin"], scheme=block["scheme"])
    np.testing.assert_allclose(ours, want, atol=1e-5)
    assert timing["up_tile_calls"] == 20


def test_tiled_parity_below_threshold_raises_naming_it(tiled):
    import torch

    from pocketdiff.runtime.bundle import load_manifest
    from pocketdiff.export.tiled_export import parity_latents, tiled_parity
    from pocketdiff.models import ModelConfig, load_or_build

    vae = load_or_build(ModelConfig(pretrained=TEACHER)).vae.to(torch.float32).eval()
    man = load_manifest(tiled["out"])
    with pytest.raises(ParityError, match=r"vae_tiling.min_psnr_db=99"):
        tiled_parity(tiled["out"], man["components"], vae, parity_latents(vae, 8, 4), man["vae_tiling"], 99.0)


def test_verify_bundle_accepts_the_tiled_components(tiled, gpu_delegate, tmp_path):
    """Both tiled graphs fully on the GPU delegate (lavapipe here) at fp16 and fp32, goldens finite and in tolerance."""
    out_json = tmp_path / "v.json"
    assert cli_main(["verify-bundle", str(tiled["out"]), "--components", ",".join(TILED), "--json", str(out_json)]) == 0
    rep = json.loads(out_json.read_text())
    for name in TILED:
        c = rep["components"][name]
        assert c["ok"] and c["fully_accelerated"] is True, (name, c)
        assert set(c["parity"]) == {"fp16", "fp32"} and all(m["finite"] for m in c["parity"].values())


def test_tiled_run_bundle_imports_no_torch(tiled, tmp_path):
    """run-bundle on a tiled bundle needs only numpy + ai-edge-litert (+ tokenizers, PIL)."""
    import subprocess
    import sys

    out = tmp_path / "run"
    code = ("import sys; from pocketdiff.cli import main; "
            f"rc = main(['run-bundle', {str(tiled['out'])!r}, '--prompt', 'a red circle', '--output', {str(out)!r}, '--accelerator', 'cpu']); "
            "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads((out / "report.json").read_text())
    assert (out / "image.png").is_file() and rep["vae_tiling"]["up_tile_calls"] == 20
    assert rep["latency_s"]["vae_up_tiles_run"] > 0
