"""run-bundle --pipelined --overlap-loads [--memory-budget-mb M] (runtime/overlap.py): each model compiled and run in a
worker process of its own, the next one during the current one, on the real LiteRT GPU delegate (lavapipe here). The
image equals --pipelined's bit for bit; every model's memory is measured by its worker and kept in the GPU cache
folder; a budget is checked from those figures before anything loads: a pair above it does not overlap (one line
says so, the order of the workers shows it), a model above it alone is refused by name and MB, no figures or another
bundle's figures are refused naming the run that makes them."""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pocketdiff.errors import PocketdiffError
from pocketdiff.runtime.managed_model import loading_policy
from pocketdiff.runtime.overlap import (FIGURES, LOAD, NONE, RUN, MemoryBudget, MemoryFigures, UnitFigures, check_budget,
                                        plan_levels, read_figures, write_figures)

WEB = Path(__file__).resolve().parents[1] / "web"
SMOKE = WEB / "smoke_bundle"
PROMPT, SEED = "a red circle", 3


def _unit(peak, resident):
    return UnitFigures(peak, resident, peak)


def _figures(bundle="b", device="d", runner=100.0, **units):
    return MemoryFigures(bundle, device, runner, {k: _unit(*v) for k, v in units.items()})


def test_figures_round_trip_and_keep_the_larger_of_each_over_launches(tmp_path):
    path = tmp_path / FIGURES
    first = _figures(text_encoder=(500.0, 300.0), unet=(1000.0, 800.0))
    assert write_figures(path, first) == first
    assert read_figures(path, "b", "d", warn=pytest.fail) == first
    again = write_figures(path, _figures(runner=90.0, text_encoder=(520.0, 250.0), unet=(900.0, 850.0)))
    assert again.launches == 2 and again.runner_mb == 100.0
    assert again.units["text_encoder"] == _unit(520.0, 300.0) and again.units["unet"] == UnitFigures(1000.0, 850.0, 1000.0)
    assert read_figures(path, "b", "d", warn=pytest.fail) == again
    with pytest.raises(ValueError, match="peak_mb must be a non-negative number of MB, got -1"):
        UnitFigures(-1, 0, 0)


@pytest.mark.parametrize("bundle,device,needle", [("other", "d", "measured for another bundle"),
                                                  ("b", "other", "measured with another device")])
def test_figures_of_another_bundle_or_device_are_ignored_with_one_warning(tmp_path, bundle, device, needle):
    path = tmp_path / FIGURES
    write_figures(path, _figures(unet=(1000.0, 800.0)))
    warnings = []
    assert read_figures(path, bundle, device, warnings.append) is None
    assert len(warnings) == 1 and needle in warnings[0] and "ignored" in warnings[0], warnings
    path.write_text("{not json")
    warnings.clear()
    assert read_figures(path, "b", "d", warnings.append) is None and len(warnings) == 1 and "unreadable" in warnings[0]


def test_each_pair_overlaps_as_far_as_the_budget_lets_and_a_model_that_cannot_fit_is_refused():
    units = ["text_encoder", "unet", "vae_decoder"]
    f = _figures(text_encoder=(500.0, 300.0), unet=(1000.0, 800.0), vae_decoder=(400.0, 200.0))
    levels = lambda mb: [p["level"] for p in plan_levels(units, f, MemoryBudget(mb), "here")]  # noqa: E731
    assert [p["level"] for p in plan_levels(units, None, None, "here")] == [LOAD, LOAD]  # no budget: all overlap
    assert levels(1600) == [LOAD, LOAD]  # 100 + 500 + 1000, 100 + 1000 + 400
    assert levels(1500) == [RUN, LOAD]  # 1600 > 1500 >= 100 + 300 + 1000
    assert levels(1399) == [NONE, RUN]  # 1400 > 1399; 1500 > 1399 >= 100 + 800 + 400
    assert levels(1299) == [NONE, NONE]
    plan = plan_levels(units, f, MemoryBudget(1299), "here")
    assert plan[1] == {"first": "unet", "then": "vae_decoder", "level": NONE, "at_once_mb": 1100.0, "overlapped_mb": 1300.0}
    with pytest.raises(PocketdiffError, match=r"--memory-budget-mb 1099: unet alone needs 1100 MB \(1000 MB measured at its "
                                              r"peak \+ the runner's 100 MB; here\)"):
        plan_levels(units, f, MemoryBudget(1099), "here")
    with pytest.raises(PocketdiffError, match="no measured memory figures .* run `pocketdiff run-bundle BUNDLE --pipelined "
                                              "--overlap-loads"):
        plan_levels(units, None, MemoryBudget(5000), "here")
    with pytest.raises(PocketdiffError, match="have none for vae_decoder"):
        plan_levels(units, _figures(text_encoder=(1, 1), unet=(1, 1)), MemoryBudget(5000), "here")


def test_flags_that_cannot_go_together_are_refused_by_name():
    for kwargs in ({}, {"pipelined": True, "stream_unet": True}, {"pipelined": True, "accelerator": "cpu"}):
        kwargs = {"accelerator": "gpu", **kwargs}
        with pytest.raises(PocketdiffError, match="--overlap-loads .* needs --pipelined and --accelerator gpu"):
            loading_policy(kwargs.pop("accelerator"), overlap_loads=True, **kwargs)
    assert loading_policy("gpu", pipelined=True, overlap_loads=True).name == "overlapped"
    with pytest.raises(PocketdiffError, match="--memory-budget-mb .* needs --pipelined --overlap-loads"):
        check_budget(4000, overlap=False)
    for bad in (0, -5, float("nan")):
        with pytest.raises(PocketdiffError, match="--memory-budget-mb must be a positive number of MB"):
            check_budget(bad, overlap=True)


@pytest.mark.parametrize("argv,needle", [
    (["--overlap-loads"], "--overlap-loads compiles the next model in a worker process while the current one runs: it needs --pipelined"),
    (["--pipelined", "--overlap-loads", "--stream-unet"], "and no --stream-unet or --load-workers"),
    (["--memory-budget-mb", "4000", "--pipelined"], "--memory-budget-mb decides which loads of --overlap-loads overlap"),
    (["--memory-budget-mb", "-1", "--pipelined", "--overlap-loads"], "--memory-budget-mb must be a positive number of MB, got -1"),
])
def test_run_bundle_refuses_these_flags_in_one_line_before_anything_is_made(tmp_path, capsys, argv, needle):
    from pocketdiff.cli import main

    out = tmp_path / "out"
    code = main(["run-bundle", str(SMOKE), "--prompt", PROMPT, "--output", str(out), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0], err
    assert not out.exists()


def _assemble_chunked(dst: Path) -> Path:
    """The chunked smoke bundle (text_encoder.0/.1, unet.0/.1, vae_decoder), as tests/web/conftest.py assembles it."""
    spec = importlib.util.spec_from_file_location("web_conftest", WEB / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.assemble_twin_bundle(WEB / "smoke_bundle_chunked", dst)


def _check_timeline(timeline: list, plan: list) -> None:
    """The workers started as each pair's level says, and never more than two at once."""
    at = {tuple(e): i for i, e in enumerate(timeline)}
    alive = 0
    for event, _ in timeline:
        alive += {"start": 1, "end": -1}.get(event, 0)
        assert alive <= 2, timeline
    for p in plan:
        a, b = p["first"], p["then"]
        start_b, compiled_a, end_a = at[("start", b)], at[("compiled", a)], at[("end", a)]
        if p["level"] == LOAD:
            assert start_b < compiled_a, (p, timeline)
        elif p["level"] == RUN:
            assert compiled_a < start_b < end_a, (p, timeline)
        else:
            assert end_a < start_b, (p, timeline)


@pytest.fixture(scope="module")
def measured(tmp_path_factory, gpu_delegate):
    """The chunked smoke bundle run --pipelined, then --overlap-loads (two prompts: its figures written twice)."""
    from pocketdiff.runtime.run_bundle import BundleRunner

    root = tmp_path_factory.mktemp("overlap")
    bundle = _assemble_chunked(root / "bundle")
    with BundleRunner(bundle, gpu_cache=root / "cache_pipelined", pipelined=True) as runner:
        pipelined, _ = runner.run(PROMPT, seed=SEED)
    cache = root / "cache"
    with BundleRunner(bundle, gpu_cache=cache, pipelined=True, overlap_loads=True) as runner:
        images, stats = zip(*(runner.run(PROMPT, seed=SEED) for _ in range(2)))
        workers = len(runner.sampler.others)
    return {"bundle": bundle, "cache": cache, "pipelined": pipelined, "images": images, "stats": stats, "workers": workers,
            "figures": MemoryFigures.from_json(json.loads((cache / FIGURES).read_text()))}


def test_overlap_gives_the_pipelined_image_and_measures_every_model(measured):
    assert all(np.array_equal(image, measured["pipelined"]) for image in measured["images"])
    stats = measured["stats"][-1]
    assert stats["fully_accelerated"] and stats["memory"]["loading_policy"] == "overlapped"
    overlap = stats["memory"]["overlap"]
    units = ["text_encoder.0", "text_encoder.1", "unet", "vae_decoder"]
    assert [p["level"] for p in overlap["plan"]] == [LOAD] * 3  # no budget: every pair overlaps
    _check_timeline(overlap["timeline"], overlap["plan"])
    assert measured["workers"] == 2 * len(units)  # a worker per model (the UNet's two chunks in one) and prompt
    compiled = [p["component"] for p in stats["memory"]["phases"] if p["phase"] == "compiled"]
    assert compiled[-5:] == ["text_encoder.0", "text_encoder.1", "unet.0", "unet.1", "vae_decoder"]
    assert all(f"{name}_wait" in stats["latency_s"] for name in compiled[-5:])  # how long the pipeline waited for each
    released = [p for p in stats["memory"]["phases"] if p["phase"] == "pages_released"]  # in each worker (runtime/file_pages.py)
    assert [p["component"] for p in released[-5:]] == compiled[-5:], released
    assert all(p["file_resident_mb_after"] < 0.05 and p["released_mb"] > 0 for p in released), released
    figures = measured["figures"]
    assert sorted(figures.units) == sorted(units) and figures.launches == 2 and figures.runner_mb > 50
    for name, f in figures.units.items():
        # each worker holds an interpreter and LiteRT (> 50 MB); its peak is never below what it held while it ran
        assert f.peak_mb >= f.resident_mb > 50 and f.host_peak_mb > 50, (name, f)


def _run_cli(tmp_path, measured, budget, capsys) -> tuple[int, list[str], Path]:
    from pocketdiff.cli import main

    out = tmp_path / f"out_{budget:g}"
    capsys.readouterr()
    code = main(["run-bundle", str(measured["bundle"]), "--prompt", PROMPT, "--seed", str(SEED), "--output", str(out),
                 "--gpu-cache", str(measured["cache"]), "--pipelined", "--overlap-loads", "--memory-budget-mb", f"{budget:g}"])
    err = [line for line in capsys.readouterr().err.splitlines() if "memory" in line]
    return code, err, out


def test_a_budget_below_a_pair_keeps_that_pair_apart_and_the_image(measured, tmp_path, capsys):
    f = MemoryFigures.from_json(json.loads((measured["cache"] / FIGURES).read_text()))
    unet, dec = f.units["unet"], f.units["vae_decoder"]
    budget = f.runner_mb + unet.resident_mb + dec.peak_mb - 0.5  # below the UNet running next to the decoder's load
    code, err, out = _run_cli(tmp_path, measured, budget, capsys)
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    plan = report["memory"]["overlap"]["plan"]
    assert report["overlap_loads"] is True and report["memory_budget_mb"] == pytest.approx(budget)
    assert plan[-1]["first"] == "unet" and plan[-1]["level"] == NONE
    for p in plan:  # every other pair as the measured figures say
        a, b = f.units[p["first"]], f.units[p["then"]]
        want = (LOAD if f.runner_mb + a.peak_mb + b.peak_mb <= budget else
                RUN if f.runner_mb + a.resident_mb + b.peak_mb <= budget else NONE)
        assert p["level"] == want, p
    said = [line for line in err if "loads after" in line]
    assert len(said) == sum(p["level"] == NONE for p in plan) and "unet and vae_decoder would hold" in said[-1], err
    _check_timeline(report["memory"]["overlap"]["timeline"], plan)
    png = np.asarray(Image.open(out / "image.png"))
    np.testing.assert_array_equal(png, (np.clip(measured["pipelined"], 0, 1) * 255).round().astype(np.uint8))


def test_a_model_that_cannot_fit_is_refused_before_loading(measured, tmp_path, capsys):
    f = MemoryFigures.from_json(json.loads((measured["cache"] / FIGURES).read_text()))  # as the launches so far left them
    biggest = max(f.units, key=lambda u: f.units[u].peak_mb)
    need = f.runner_mb + f.units[biggest].peak_mb
    before = (measured["cache"] / FIGURES).read_text()
    code, err, out = _run_cli(tmp_path, measured, need - 1, capsys)
    assert code == 2 and len(err) == 1, err
    assert f"{biggest} alone needs {need:.0f} MB" in err[0] and "cannot run within the budget" in err[0], err
    assert not out.exists() and (measured["cache"] / FIGURES).read_text() == before  # nothing ran


def test_no_figures_or_another_bundles_figures_name_the_run_that_makes_them(measured, tmp_path, capsys):
    from pocketdiff.runtime.run_bundle import BundleRunner

    bundle = shutil.copytree(SMOKE, tmp_path / "bundle")
    with pytest.raises(PocketdiffError, match=r"no measured memory figures .* run `pocketdiff run-bundle BUNDLE --pipelined "
                                              r"--overlap-loads"):
        BundleRunner(bundle, gpu_cache=tmp_path / "fresh", pipelined=True, overlap_loads=True, memory_budget_mb=1e6)
    other = tmp_path / "other"  # the chunked bundle's figures in this bundle's cache folder
    other.mkdir()
    shutil.copyfile(measured["cache"] / FIGURES, other / FIGURES)
    capsys.readouterr()
    with pytest.raises(PocketdiffError, match="no measured memory figures"):
        BundleRunner(bundle, gpu_cache=other, pipelined=True, overlap_loads=True, memory_budget_mb=1e6)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "measured for another bundle; ignored" in warnings[0], warnings
    with pytest.raises(PocketdiffError, match="--memory-budget-mb reads the measured figures kept in the GPU cache folder"):
        BundleRunner(bundle, gpu_cache=False, pipelined=True, overlap_loads=True, memory_budget_mb=1e6)
