"""run-bundle --load-workers N (runtime/load_workers.py): the models compiled in N worker processes at once and run
there, on the real LiteRT GPU delegate (lavapipe here). The image equals the one-process image bit for bit, for a
bundle in chunks and a tiled decoder alike; the report counts the workers' memory and says how many there were;
options that cannot go with it are refused by name."""
from __future__ import annotations

import json

import numpy as np
import pytest

PROMPT, SEED = "a red circle", 3


@pytest.fixture(scope="module", params=["chunked", "tiled"])
def bundle(request, tmp_path_factory, assemble_chunked, assemble_tiled):
    assemble = assemble_chunked if request.param == "chunked" else assemble_tiled
    return assemble(tmp_path_factory.mktemp(f"workers_{request.param}"))


def test_workers_give_the_one_process_image_and_count_their_memory(bundle, gpu_delegate):
    from pocketdiff.runtime.run_bundle import BundleRunner

    man = json.loads((bundle / "manifest.json").read_text())
    images, stats = {}, {}
    for workers in (0, 3):
        with BundleRunner(bundle, gpu_cache=False, load_workers=workers) as runner:
            images[workers], stats[workers] = runner.run(PROMPT, seed=SEED)
            if workers:  # a second prompt reuses the workers' models: nothing loads again
                again, second = runner.run(PROMPT, seed=SEED)
                assert np.array_equal(again, images[workers])
                assert not any(k.endswith("_load") for k in second["latency_s"]), second["latency_s"]
    assert np.array_equal(images[0], images[3])
    assert stats[3]["fully_accelerated"] and stats[3]["finite"]
    mem = stats[3]["memory"]
    assert mem["processes"] == 4 and stats[0]["memory"]["processes"] == 1
    assert mem["environments"] == "workers" and stats[0]["memory"]["environments"] == "one"  # the models live in the workers
    # each worker is a whole interpreter with LiteRT loaded: three of them add more than 100 MB to the host peak
    assert mem["host_peak_mb"] > stats[0]["memory"]["host_peak_mb"] + 100, (mem["host_peak_mb"], stats[0]["memory"]["host_peak_mb"])
    compiled = [p["component"] for p in mem["phases"] if p["phase"] == "compiled"]
    assert sorted(compiled) == sorted(man["components"]), compiled
    assert all(stats[3]["latency_s"][f"{name}_load"] > 0 for name in man["components"])
    assert stats[3]["latency_s"]["unet_steps"] > 0


def test_load_workers_are_refused_with_pipelined_or_cpu_and_must_be_positive(tmp_path, assemble_chunked):
    from pocketdiff.errors import PocketdiffError
    from pocketdiff.runtime.run_bundle import BundleRunner

    b = assemble_chunked(tmp_path / "b")
    for kwargs in ({"pipelined": True}, {"accelerator": "cpu"}):
        with pytest.raises(PocketdiffError, match="--load-workers .* needs --accelerator gpu and no --pipelined"):
            BundleRunner(b, gpu_cache=False, load_workers=2, **kwargs)
    with pytest.raises(PocketdiffError, match="--load-workers must be a positive integer, got -1"):
        BundleRunner(b, gpu_cache=False, load_workers=-1)


def test_cli_writes_load_workers_in_the_report(tmp_path, assemble_chunked, gpu_delegate):
    from pocketdiff.cli import main

    b = assemble_chunked(tmp_path / "b")
    assert main(["run-bundle", str(b), "--prompt", PROMPT, "--output", str(tmp_path / "out"), "--no-gpu-cache",
                 "--load-workers", "2"]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["load_workers"] == 2 and report["memory"]["processes"] == 3
    assert report["host_peak_mb"] > 0 and report["start_s"] is not None
