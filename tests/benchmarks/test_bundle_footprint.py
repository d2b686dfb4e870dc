"""benchmarks/bundle_footprint.py's load-overlap probe (`parallel`) on the real LiteRT GPU delegate (lavapipe here):
the files split by bytes over processes started at once, an environment per model, and one load window across them."""
from __future__ import annotations

from pathlib import Path

import pytest
from script_module import load_script  # tests/script_module.py

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "tests" / "web" / "smoke_bundle"


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bundle_footprint.py", "bundle_footprint_bench")


def test_files_are_split_over_processes_by_bytes(bench, tmp_path):
    paths = []
    for size in (5, 4, 3, 2, 1):
        p = tmp_path / f"m{size}.tflite"
        p.write_bytes(b"x" * size * 1000)
        paths.append(str(p))
    groups = bench._balanced(paths, 2)
    assert sorted(q for g in groups for q in g) == sorted(paths)
    assert sorted(sum(Path(q).stat().st_size for q in g) for g in groups) == [7000, 8000]
    assert len(bench._balanced(paths[:1], 4)) == 1  # never an empty process


def test_parallel_in_processes_loads_every_file_and_lines_up_one_window(bench, gpu_delegate, tmp_path):
    from pocketdiff.runtime.delegate import prepare_in_process

    prepare_in_process()  # the children inherit the Vulkan driver's environment
    files = [str(SMOKE / "text_encoder.tflite"), str(SMOKE / "unet.tflite")]
    rows = bench.parallel(files, [2], str(tmp_path), timeout=300, env_each=True, proc_counts=(2,))
    assert [(r["threads"], r["processes"], r["launch"]) for r in rows] == [(2, 1, "cold"), (2, 1, "warm"), (1, 2, "cold"), (1, 2, "warm")]
    for r in rows:
        assert "error" not in r, r
        assert r["environments"] == "each"
        assert r["finite"] == [True, True]
    split = rows[2]
    assert sorted(m for c in split["children"] for m in c["models"]) == ["text_encoder.tflite", "unet.tflite"]
    assert split["load_wall_s"] >= max(c["load_wall_s"] for c in split["children"]) - 0.01
    assert split["host_peak_mb"] == pytest.approx(sum(c["host_peak_mb"] for c in split["children"]), abs=0.2)


def test_stream_loads_runs_and_releases_each_chunk_per_round(bench, gpu_delegate, tmp_path):
    from pocketdiff.runtime.delegate import prepare_in_process

    prepare_in_process()
    files = [str(SMOKE / "text_encoder.tflite"), str(SMOKE / "unet.tflite")]
    for env_each in (True, False):
        row = bench.stream(files, rounds=2, env_each=env_each, cache=str(tmp_path / "cache"))
        assert row["environments"] == ("each" if env_each else "shared")
        assert len(row["load_s"]) == 4 and all(s > 0 for s in row["load_s"])
        released = [p["phase"] for p in row["phases"] if p["phase"].endswith(".released")]
        assert released == ["0.text_encoder.released", "0.unet.released", "1.text_encoder.released", "1.unet.released"]
    marked = bench.stream(files[:1], rounds=1, env_each=True, cache=str(tmp_path / "cache"), marks=True)
    assert [p["phase"] for p in marked["phases"]][:3] == ["0.text_encoder.opened", "0.text_encoder.compiled", "0.text_encoder.released"]
