"""run-bundle's start-up levers (issue 66 items 3 and 4), each off by default, on the smoke bundles on the GPU
delegate (lavapipe here): `on_cpu` (a component on XNNPACK beside the GPU, its int8 file's CPU variant made once and
kept), `one_environment` (pipelined models in one LiteRT environment), `overlap_ahead` (the overlapped loader compiling
several models ahead), `compile_ahead` (the next GPU model compiled in a thread), an app keeping its UNet and decoder
with the text encoder on the CPU; and each flag refused in one line where it cannot hold. No timings are asserted: what ran where, what loaded how often, and the images."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from pocketdiff.errors import PocketdiffError
from pocketdiff.runtime.managed_model import loading_policy
from pocketdiff.runtime.overlap import check_ahead

WEB = Path(__file__).resolve().parents[1] / "web"
PROMPT, SEED = "a red circle", 3
UNET = ("unet.0", "unet.1", "unet.2", "unet.3")


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)  # images in [0, 1]


def _assemble(name: str, dst: Path) -> Path:
    spec = importlib.util.spec_from_file_location("web_conftest", WEB / "conftest.py")  # how tests/web assembles twins
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.assemble_twin_bundle(WEB / name, dst)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, gpu_delegate):
    """One prompt through the pipelined runner and each lever, on one program cache: the tiny smoke bundle (a chunked UNet),
    and for the overlapped loader the one whose decoder is a head and an up path in two graphs (four GPU units)."""
    from pocketdiff.runtime.run_bundle import BundleRunner

    root = tmp_path_factory.mktemp("levers")
    bundle, parts, cache = _assemble("smoke_bundle_tiny", root / "bundle"), _assemble("smoke_bundle_tiled_parts", root / "parts"), root / "cache"
    out = {"bundle": bundle, "cache": cache}
    te_cpu = {"on_cpu": ("text_encoder",)}
    for key, b, kwargs in (("base", bundle, {}), ("te_cpu", bundle, te_cpu), ("te_cpu_again", bundle, te_cpu),
                           ("one_env", bundle, {"one_environment": True}), ("parts_te_cpu", parts, te_cpu),
                           ("ahead", parts, {"overlap_loads": True, "overlap_ahead": 3, **te_cpu}),
                           ("thread", parts, {"compile_ahead": True, **te_cpu})):
        with BundleRunner(b, gpu_cache=cache, pipelined=True, **kwargs) as runner:
            out[key] = runner.run(PROMPT, seed=SEED)
    return out


def _phases(stats: dict, component: str) -> list[str]:
    return [p["phase"] for p in stats["memory"]["phases"] if p["component"] == component]


def test_the_text_encoder_runs_on_the_cpu_and_the_image_stays_the_gpus(runs):
    base, base_stats = runs["base"]
    image, stats = runs["te_cpu"]
    assert stats["accelerator_by_model"] == {"text_encoder": "cpu", **{n: "gpu" for n in UNET}, "vae_decoder": "gpu"}
    assert base_stats["accelerator_by_model"]["text_encoder"] == "gpu"
    assert "text_encoder" not in stats["fully_accelerated_by_component"] and stats["fully_accelerated"]  # the GPU's models all on it
    assert _phases(stats, "text_encoder")[:2] == ["cpu_variant", "opened"]  # the int8 file's CPU variant, then XNNPACK
    # the encoder's states differ (fp32 XNNPACK against the GPU's fp16) and the image moves a little: the bundle contract's
    # bar between two runners of one bundle (runtime/BUNDLE.md, Tolerances: the page against run-bundle, >= 30 dB)
    assert not np.array_equal(image, base)
    assert psnr(image, base) >= 30.0, psnr(image, base)


def test_the_cpu_variant_is_made_at_the_first_launch_and_read_at_the_next(runs):
    made = [p.get("variant") for p in runs["te_cpu"][1]["memory"]["phases"] if p["phase"] == "cpu_variant"]
    kept = [p.get("variant") for p in runs["te_cpu_again"][1]["memory"]["phases"] if p["phase"] == "cpu_variant"]
    assert made == ["made"] and kept == ["kept"], (made, kept)
    from pocketdiff.runtime.bundle import load_manifest
    from pocketdiff.runtime.cpu_variant import VARIANT_VERSION

    sha = load_manifest(runs["bundle"])["components"]["text_encoder"]["sha256"]
    files = sorted(p.name for p in (runs["cache"] / "cpu").iterdir())
    assert files == [f"{sha}.v{VARIANT_VERSION}.tflite"], files  # named by the source's sha256; no private file left behind
    np.testing.assert_allclose(runs["te_cpu_again"][0], runs["te_cpu"][0], atol=1e-6)  # the same variant file and models


def test_xnnpack_packs_the_cpu_text_encoder_at_the_first_launch_and_maps_it_at_the_next(runs):
    """runtime/xnnpack_cache.py: the packed weights kept in the cache folder's xnnpack/ (the image equality above holds
    with the second launch reading them)."""
    states = {k: [p.get("state") for p in runs[k][1]["memory"]["phases"] if p["phase"] == "xnnpack_cache" and p["component"] == "text_encoder"]
              for k in ("te_cpu", "te_cpu_again")}
    assert states == {"te_cpu": ["made"], "te_cpu_again": ["reused"]}, states
    files = sorted(p.name for p in (runs["cache"] / "xnnpack").glob("text_encoder-*"))
    assert len(files) == 2 and files[1] == files[0] + ".ok", files  # one packed file and its sidecar, no private file


def test_one_environment_loads_and_releases_each_model_as_pipelined_and_gives_its_image(runs):
    image, stats = runs["one_env"]
    mem = stats["memory"]
    assert mem["environments"] == "one" and runs["base"][1]["memory"]["environments"] == "own"
    assert mem["loading_policy"] == "pipelined"
    for name, m in mem["models"].items():
        assert m["loads"] == 1 and m["phases"][-1]["phase"] == "released", name  # each released after its use
    np.testing.assert_array_equal(image, runs["base"][0])  # the same programs on the same device; only the environment differs


def test_overlap_ahead_compiles_the_unet_and_every_decoder_graph_together_while_the_text_encoder_runs_on_the_cpu(runs):
    image, stats = runs["ahead"]
    overlap = stats["memory"]["overlap"]
    assert overlap["ahead"] == 3
    units = ["unet", "vae_decoder_head", "vae_up_tile.0", "vae_up_tile.1"]  # the CPU encoder is no worker's unit
    assert [(p["first"], p["then"]) for p in overlap["plan"]] == list(zip(units, units[1:]))
    events = [tuple(e) for e in overlap["timeline"]]
    assert events[:4] == [("start", u) for u in units], events  # all four compiling at once (ahead 1: two at a time)
    assert stats["accelerator_by_model"]["text_encoder"] == "cpu"
    assert _phases(stats, "text_encoder")[0] == "opened"  # loaded here, in the runner's process (an fp16 file: no variant)
    # the same models on the same accelerators as the pipelined runner's, only compiled in worker processes
    np.testing.assert_allclose(image, runs["parts_te_cpu"][0], atol=1e-6)


def test_compile_ahead_compiles_the_unet_during_the_cpu_encoder_and_the_decoder_head_during_the_steps(runs):
    image, stats = runs["thread"]
    assert stats["memory"]["compiled_ahead"] == ["unet", "vae_decoder_head"]
    marks = [(p["component"], p["phase"]) for p in stats["memory"]["phases"]]
    # the head's load began in the thread during the steps (when its compile ends depends on the machine's load)
    assert marks.index(("vae_decoder_head", "opened")) < marks.index(("unet", "released")), marks
    assert marks.index(("vae_up_tile.0", "opened")) > marks.index(("vae_decoder_head", "released")), marks  # then one at a time
    assert {"unet_wait", "vae_decoder_head_wait"} <= set(stats["latency_s"])  # what the stage before did not hide
    assert stats["accelerator_by_model"]["text_encoder"] == "cpu"
    np.testing.assert_allclose(image, runs["parts_te_cpu"][0], atol=1e-6)  # the same models in the same process


def test_an_app_keeps_its_unet_and_decoder_and_reloads_the_cpu_text_encoder(runs):
    """Issue 66 item 4's candidate: keep=("unet", "vae_decoder") with the text encoder on the CPU, three prompts."""
    from pocketdiff.runtime.run_bundle import BundleRunner

    with BundleRunner(runs["bundle"], gpu_cache=runs["cache"], pipelined=True, keep=("unet", "vae_decoder"),
                      on_cpu=("text_encoder",)) as runner:
        for _ in range(3):
            image, stats = runner.run(PROMPT, seed=SEED)
            assert set(runner.loaded) == {*UNET, "vae_decoder"}  # the encoder went after its use
        loads = {n: m["loads"] for n, m in stats["memory"]["models"].items()}
    assert loads == {"text_encoder": 3, **{n: 1 for n in UNET}, "vae_decoder": 1}, loads
    np.testing.assert_allclose(image, runs["te_cpu"][0], atol=1e-6)  # the pipelined te_cpu image: only the loading differs


def test_the_policies_and_the_ahead_count():
    assert loading_policy("gpu", pipelined=True, one_environment=True).own_environments is False
    assert loading_policy("gpu", pipelined=True, keep=("unet",), one_environment=True).own_environments is False
    assert loading_policy("gpu", pipelined=True).own_environments is True
    assert check_ahead(None, False, None) == 1 and check_ahead(3, True, None) == 3
    for bad in (0, -1, True, 2.5):
        with pytest.raises(PocketdiffError, match="--overlap-ahead .*: must be a whole number"):
            check_ahead(bad, True, None)


@pytest.mark.parametrize("argv,needle", [
    (["--on-cpu", "text_encodr"], "--on-cpu text_encodr: not a component (components: text_encoder, "),
    (["--on-cpu", "text_encoder", "--accelerator", "cpu"], "--on-cpu text_encoder runs those components on the CPU beside the GPU: it needs --accelerator gpu"),
    (["--on-cpu", "vae_encoder", "--pipelined"], "--on-cpu vae_encoder: no stage of bundle"),
    (["--compile-ahead"], "--compile-ahead compiles the next GPU model in a thread while the current stage runs: it needs --pipelined"),
    (["--compile-ahead", "--pipelined", "--overlap-loads"], "and no --overlap-loads or --stream-unet"),
    (["--one-environment"], "--one-environment keeps a pipelined runner's models in one LiteRT environment: it needs --pipelined"),
    (["--one-environment", "--pipelined", "--overlap-loads"], "and no --overlap-loads"),
    (["--overlap-ahead", "0", "--pipelined", "--overlap-loads"], "--overlap-ahead 0: must be a whole number of models, 1 or more"),
    (["--overlap-ahead", "2", "--pipelined"], "--overlap-ahead 2 compiles that many models ahead in worker processes: it needs"),
    (["--overlap-ahead", "2", "--pipelined", "--overlap-loads", "--memory-budget-mb", "4000"], "and no --memory-budget-mb"),
])
def test_run_bundle_refuses_a_lever_that_cannot_hold_in_one_line_before_anything_is_made(tmp_path, capsys, argv, needle):
    from pocketdiff.cli import main

    out = tmp_path / "out"
    code = main(["run-bundle", str(WEB / "smoke_bundle"), "--prompt", PROMPT, "--output", str(out), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0], err
    assert not out.exists()


def test_on_cpu_is_one_check_and_the_runner_takes_run_bundles_checked_components():
    """runtime/cli_checks.check_on_cpu: names, a GPU runner and, given the manifest, the bundle's stages; what it passed
    against a manifest (run-bundle's, before --output) the runner takes as it is, without checking it again."""
    import json

    from pocketdiff.runtime.cli_checks import CheckedOnCpu, check_on_cpu

    man = json.loads((WEB / "smoke_bundle" / "manifest.json").read_text())
    assert check_on_cpu(" text_encoder, ", "gpu") == ("text_encoder",) and check_on_cpu(None, "cpu") == ()
    checked = check_on_cpu("text_encoder", "gpu", man, "b")
    assert isinstance(checked, CheckedOnCpu) and checked == ("text_encoder",)
    with pytest.raises(PocketdiffError, match="--on-cpu vae_encoder: no stage of bundle b runs it"):
        check_on_cpu("vae_encoder", "gpu", man, "b")
    assert check_on_cpu(checked, "cpu", man, "b") is checked  # not checked again (with --accelerator cpu it would be refused)


def test_a_kept_cpu_variant_that_is_not_a_whole_file_is_made_again_with_one_warning(tmp_path, capsys):
    from pocketdiff.runtime.cpu_variant import VARIANT_VERSION, kept_variant
    from pocketdiff.runtime.tflite_file import check_tflite_file

    src = WEB / "smoke_bundle_tiny" / "text_encoder.tflite"
    folder = tmp_path / "cpu"
    folder.mkdir()
    (folder / f".tmp-99999-abc.v{VARIANT_VERSION}.tflite").write_bytes(b"half")  # a killed launch's private file: never read
    path, made = kept_variant(src, "abc", folder)
    assert made and Path(path).name == f"abc.v{VARIANT_VERSION}.tflite"
    whole = Path(path).read_bytes()
    assert kept_variant(src, "abc", folder) == (path, False) and capsys.readouterr().err == ""
    Path(path).write_bytes(whole[: len(whole) // 2])  # cut short
    assert kept_variant(src, "abc", folder) == (path, True)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: CPU variant: ") and err[0].endswith("made again"), err
    check_tflite_file(path)
    assert Path(path).read_bytes() == whole  # the same conversion of the same file
