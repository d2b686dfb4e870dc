"""Managed models and loading policies (runtime/managed_model.py): the policy each run-bundle flag set gets, a
contradictory or empty set refused in one line (exit 2), a model loaded on use and released on request, and the
runner on the smoke bundle (CPU) choosing by policy: plain keeps every model, pipelined releases each after its
use, the image the same."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from pocketdiff.errors import PocketdiffError
from pocketdiff.runtime.managed_model import ManagedModel, loading_policy

SMOKE = Path(__file__).resolve().parents[1] / "web" / "smoke_bundle"


def test_each_flag_set_gets_its_policy():
    assert loading_policy("gpu").name == "plain" and loading_policy("gpu").up_front
    piped = loading_policy("gpu", pipelined=True)
    assert (piped.name, piped.up_front, piped.release_after_use, piped.own_environments) == ("pipelined", False, True, True)
    assert loading_policy("cpu", pipelined=True).own_environments is False  # no LiteRT GPU environments on the CPU
    streamed = loading_policy("gpu", pipelined=True, stream_unet=True)
    assert streamed.name == "streamed" and streamed.stream_unet
    workers = loading_policy("gpu", load_workers=3)
    assert (workers.name, workers.load_workers, workers.up_front, workers.release_after_use) == ("workers", 3, True, False)
    with pytest.raises(PocketdiffError, match="--stream-unet .* needs --pipelined"):
        loading_policy("gpu", stream_unet=True)
    with pytest.raises(PocketdiffError, match="--load-workers .* no --pipelined"):
        loading_policy("gpu", pipelined=True, load_workers=2)
    with pytest.raises(PocketdiffError, match="--load-workers must be a positive integer, got -1"):
        loading_policy("gpu", load_workers=-1)


def test_managed_model_loads_on_use_and_releases_on_request():
    events = []

    class Model:
        load_s = 0.25

    managed = ManagedModel("unet", lambda: events.append("open") or Model(), lambda m: events.append(("close", type(m).__name__)))
    assert not managed.loaded and managed.release() is False and events == []
    first = managed.get()
    assert managed.get() is first and managed.loaded and events == ["open"]  # loaded once, on the first use
    assert managed.release() is True and not managed.loaded and events == ["open", ("close", "Model")]
    managed.get()
    assert managed.memory()["loads"] == 2 and managed.memory()["load_s"] == [0.25, 0.25]


@pytest.mark.parametrize("argv,needle", [
    (["--load-workers", "0"], "--load-workers must be a positive integer, got 0"),
    (["--gpu-cache", "{tmp}/cache", "--no-gpu-cache"], "--no-gpu-cache contradict each other"),
])
def test_run_bundle_refuses_empty_or_contradictory_flags(tmp_path, capsys, argv, needle):
    from pocketdiff.cli import main

    out = tmp_path / "out"
    code = main(["run-bundle", str(SMOKE), "--prompt", "a red circle", "--output", str(out), "--accelerator", "cpu",
                 *[a.format(tmp=tmp_path) for a in argv]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0], err
    assert not out.exists() and not (tmp_path / "cache").exists()  # refused before anything was made


def test_runner_releases_by_policy_and_the_image_is_the_same(tmp_path):
    from pocketdiff.runtime.run_bundle import BundleRunner

    bundle = shutil.copytree(SMOKE, tmp_path / "bundle")
    images, seen = {}, {}
    for pipelined in (False, True):
        with BundleRunner(bundle, "cpu", pipelined=pipelined) as runner:
            images[pipelined], stats = runner.run("a red circle", seed=3)
            seen[pipelined] = (set(runner.loaded), stats["memory"])
    (plain_loaded, plain_mem), (piped_loaded, piped_mem) = seen[False], seen[True]
    assert plain_loaded == {"text_encoder", "unet", "vae_decoder"} and piped_loaded == set()
    assert (plain_mem["loading_policy"], piped_mem["loading_policy"]) == ("plain", "pipelined")
    released = [p["component"] for p in piped_mem["phases"] if p["phase"] == "released"]
    assert released == ["text_encoder", "unet", "vae_decoder"]  # each right after its use, in the order of use
    assert not [p for p in plain_mem["phases"] if p["phase"] == "released"]
    assert [p["phase"] for p in piped_mem["models"]["unet"]["phases"]][-1] == "released"
    np.testing.assert_array_equal(images[False], images[True])


def test_an_app_keeps_its_unet_between_prompts_and_loads_the_others_around_it(tmp_path):
    """`keep=("unet",)` (pipelined): the UNet loads once for every prompt, the text encoder and decoder load just in time
    for each and go after their use; the images are the plain runner's (issue 66 item 4)."""
    from pocketdiff.runtime.run_bundle import BundleRunner

    bundle = shutil.copytree(SMOKE, tmp_path / "bundle")
    with BundleRunner(bundle, "cpu") as plain:
        want = [plain.run("a red circle", seed=s)[0] for s in (3, 4, 5)]
    with BundleRunner(bundle, "cpu", pipelined=True, keep=("unet",)) as runner:
        got = []
        for s in (3, 4, 5):
            image, stats = runner.run("a red circle", seed=s)
            got.append(image)
            assert set(runner.loaded) == {"unet"}  # the text encoder and decoder went after their use
        loads = {n: m["loads"] for n, m in stats["memory"]["models"].items()}
    assert loads == {"text_encoder": 3, "unet": 1, "vae_decoder": 3}, loads
    assert stats["memory"]["loading_policy"] == "pipelined"
    for a, b in zip(want, got):
        np.testing.assert_allclose(a, b, atol=1e-6)  # the same models on the same inputs; only the loading differs


@pytest.mark.parametrize("kwargs,needle", [
    ({"keep": ("unet",)}, "needs --pipelined"),
    ({"keep": ("unet",), "pipelined": True, "stream_unet": True}, "nor --stream-unet with --keep unet"),
    ({"keep": ("vae_encoder",), "pipelined": True}, "--keep vae_encoder: no stage of bundle"),
])
def test_keep_is_refused_in_one_line_where_it_cannot_hold(kwargs, needle, tmp_path):
    from pocketdiff.errors import PocketdiffError
    from pocketdiff.runtime.run_bundle import BundleRunner

    with pytest.raises(PocketdiffError, match=re.escape(needle)):
        BundleRunner(SMOKE, "cpu", **kwargs)


def test_keeping_a_tiled_decoder_keeps_its_head_and_up_path(tmp_path):
    """`keep=("unet", "vae_decoder")` on a bundle whose decoder is tiled: its head and up tile stay too."""
    import importlib.util

    from pocketdiff.runtime.run_bundle import BundleRunner

    web = SMOKE.parent
    spec = importlib.util.spec_from_file_location("web_conftest", web / "conftest.py")  # how tests/web assembles twins
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    bundle = module.assemble_twin_bundle(web / "smoke_bundle_tiled", tmp_path / "tiled")
    with BundleRunner(bundle, "cpu", pipelined=True, keep=("unet", "vae_decoder")) as runner:
        for s in (3, 4):
            _, stats = runner.run("a red circle", seed=s)
        assert set(runner.loaded) == {"unet", "vae_decoder_head", "vae_up_tile"}
        loads = {n: m["loads"] for n, m in stats["memory"]["models"].items()}
    assert loads == {"text_encoder": 2, "unet": 1, "vae_decoder_head": 1, "vae_up_tile": 1}, loads
