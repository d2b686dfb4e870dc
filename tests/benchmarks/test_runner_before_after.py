"""benchmarks/runner_before_after.py without a GPU: the version-2 copy of a bundle (what the code before the runner
refactor reads), and the timeline of a report's phases (each second of a sequential launch attributed once)."""
from __future__ import annotations

import json
import os

import pytest
from script_module import load_script  # tests/script_module.py


@pytest.fixture(scope="module")
def rba():
    return load_script("benchmarks/runner_before_after.py", "runner_before_after_bench")


def _bundle(tmp_path):
    b = tmp_path / "b"
    (b / "sub").mkdir(parents=True)
    (b / "unet.0.tflite").write_bytes(b"u0")
    (b / "sub" / "tok.json").write_text("{}")
    man = {"schema": "pocketdiff.bundle", "schema_version": 3, "components": {"unet.0": {}, "text_encoder": {}},
           "pipeline": {"stages": []}}
    (b / "manifest.json").write_text(json.dumps(man))
    return b, man


def test_v2_copy_drops_the_pipeline_and_links_the_files(rba, tmp_path):
    b, man = _bundle(tmp_path)
    info = rba.v2_copy(b, tmp_path / "v2")
    out = json.loads((tmp_path / "v2" / "manifest.json").read_text())
    assert "pipeline" not in out and out["schema_version"] == 2  # unet.0: a chunked model
    assert {k: v for k, v in out.items() if k != "schema_version"} == {k: v for k, v in man.items() if k not in ("pipeline", "schema_version")}
    assert info == {"from_version": 3, "to_version": 2, "dropped": ["pipeline"]}
    assert os.path.samefile(b / "unet.0.tflite", tmp_path / "v2" / "unet.0.tflite")
    assert (tmp_path / "v2" / "sub" / "tok.json").read_text() == "{}"
    assert json.loads((b / "manifest.json").read_text()) == man  # the source is left as it was


def test_v2_copy_of_a_whole_model_bundle_is_version_1(rba, tmp_path):
    b = tmp_path / "w"
    b.mkdir()
    (b / "manifest.json").write_text(json.dumps({"schema_version": 3, "components": {"unet": {}}, "pipeline": {}}))
    rba.v2_copy(b, tmp_path / "w1")
    assert json.loads((tmp_path / "w1" / "manifest.json").read_text())["schema_version"] == 1


def _row():
    ph = lambda c, p, t: {"component": c, "phase": p, "t_s": t}  # noqa: E731
    phases = [ph("runner", "ready", 3.0), ph("text_encoder", "opened", 3.0), ph("text_encoder", "compiled", 5.0),
              ph("text_encoder", "first_run", 5.5), ph("text_encoder", "released", 5.6),
              ph("unet.0", "opened", 5.7), ph("unet.0", "compiled", 9.0), ph("unet.1", "opened", 9.0),
              ph("unet.1", "compiled", 12.0),
              ph("unet.0", "first_run", 12.4), ph("unet.1", "first_run", 12.4),
              ph("unet.0", "steady_run", 13.0), ph("unet.1", "steady_run", 13.0),
              ph("unet.0", "released", 13.1), ph("unet.1", "released", 13.2)]
    return {"total_s": 14.0, "memory": {"startup_s": {"main": 2.0, "bundle_checked": 2.8, "runner_ready": 3.0},
                                        "phases": phases}}


def test_timeline_attributes_every_second_once(rba):
    items = rba.intervals(_row())
    assert items[0] == {"component": "process", "item": "interpreter + imports", "t0": 0.0, "t1": 2.0, "s": 2.0}
    assert sum(it["s"] for it in items) == pytest.approx(14.0)  # process start to the image, no gap, no overlap
    for a, b in zip(items, items[1:]):
        assert b["t0"] == pytest.approx(a["t1"])
    steps = [it for it in items if it["component"] == "unet" and it["item"] in ("step 1", "later steps")]
    assert [(it["item"], it["s"]) for it in steps] == [("step 1", pytest.approx(0.4)), ("later steps", pytest.approx(0.6))]
    assert items[-1]["item"] == "decode tail + image" and items[-1]["s"] == pytest.approx(0.8)


def test_largest_sums_a_chunked_models_parts(rba):
    top = rba.largest(rba.intervals(_row()), n=2)
    assert top[0] == {"what": "unet compile", "s": pytest.approx(6.3)}  # unet.0 3.3 s + unet.1 3.0 s
    assert top[1]["what"] == "text_encoder compile" or top[1]["what"] == "process interpreter + imports"


def test_records_name_no_scratch_path(rba):
    doc = {"a": ["/tmp/rba-cache/x/programs", "see /tmp/site/y"], "b": {"c": "x/tmp/keep", "d": 3}}
    assert rba._relative(doc) == {"a": ["rba-cache/x/programs", "see site/y"], "b": {"c": "x/tmp/keep", "d": 3}}


def test_startup_levers_rows_read_as_reports_and_plot(rba, tmp_path):
    """startup_levers.py / sdxl_bundle.sh rows keep run-bundle's marks as `marks` and its startup seconds as `startup_s`:
    the timeline reads them the same way, and `timeline --mode` plots that configuration's cold and warm launches."""
    import json

    full = _row()
    row = {"mode": "te_cpu", "launch": "cold", "total_s": 14.0, "start_s": 12.4, "flags": ["--pipelined", "--on-cpu", "text_encoder"],
           "startup_s": full["memory"]["startup_s"], "marks": full["memory"]["phases"]}
    assert rba.intervals(rba.as_report(row)) == rba.intervals(full)
    results = tmp_path / "startup.json"
    results.write_text(json.dumps({"rows": [row, {**row, "launch": "warm"}, {**row, "mode": "pipelined"}]}))
    out = tmp_path / "t.png"
    assert rba.main(["timeline", str(results), "--mode", "te_cpu", "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000
    with pytest.raises(SystemExit, match="no overlap launch"):
        rba.main(["timeline", str(results), "--mode", "overlap", "--out", str(out)])
