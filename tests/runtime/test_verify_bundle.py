"""`pocketdiff verify-bundle`: a bundle's checks on this machine without torch; each failure
exits 2 naming the component and the check."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from pocketdiff.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """The shipped tiny teacher's text encoder alone (the quickest real component to convert), int8."""
    root = tmp_path_factory.mktemp("verify")
    cfg = {
        "seed": 0,
        "model": {"pretrained": "pocketdiff:shapes-teacher"},
        "components": ["text_encoder"],
        "weights": "int8",  # RTN int8 weights: the CPU variant (runtime/cpu_variant.py) is tested on it too
        "int8": {"rtn": True, "components": ["text_encoder"]},
        "guidance": "cfg",
        "steps": 4,
        "verify": {"delegate": False},
        "fp16_scan": {"enabled": False},
    }
    (root / "export.yaml").write_text(yaml.safe_dump(cfg))
    out = root / "bundle"
    assert cli_main(["export", "--config", str(root / "export.yaml"), "--output", str(out)]) == 0
    return out


def _copy(bundle: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "b"
    shutil.copytree(bundle, dst, ignore=shutil.ignore_patterns("_export"))
    return dst


def test_verify_bundle_cpu_without_torch(bundle, tmp_path):
    """The verb imports no torch (a runtime-only machine can run it) and reports per component."""
    out_json = tmp_path / "v.json"
    code = (
        "import sys; from pocketdiff.cli import main; "
        f"rc = main(['verify-bundle', {str(bundle)!r}, '--accelerator', 'cpu', '--json', {str(out_json)!r}]); "
        "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(out_json.read_text())
    te = rep["components"]["text_encoder"]
    assert rep["ok"] and te["ok"]
    assert te["checks"] == ["files", "io", "golden", "compile", "finite", "parity"]
    assert te["parity"]["fp32"]["cosine"] > 0.9999
    assert te["latency_ms"]["fp32"] > 0


def test_verify_bundle_gpu_delegate(bundle, gpu_delegate, tmp_path):
    out_json = tmp_path / "v.json"
    assert cli_main(["verify-bundle", str(bundle), "--json", str(out_json)]) == 0
    te = json.loads(out_json.read_text())["components"]["text_encoder"]
    assert te["fully_accelerated"] is True
    assert "delegate" in te["checks"]
    assert set(te["parity"]) == {"fp16", "fp32"} and all(m["finite"] for m in te["parity"].values())
    assert set(te["compile_s"]) == {"fp16", "fp32"}


def _fails(bundle: Path, capsys, *extra) -> str:
    rc = cli_main(["verify-bundle", str(bundle), "--accelerator", "cpu", *extra])
    err = capsys.readouterr().err
    assert rc == 2, err
    return err


def test_golden_sha_mismatch_and_missing_golden(bundle, tmp_path, capsys):
    b = _copy(bundle, tmp_path)
    golden = b / "golden" / "text_encoder.npz"
    data = dict(np.load(golden))
    data["output_0"] = data["output_0"] + 1.0
    np.savez(golden, **data)
    err = _fails(b, capsys)
    assert "verify-bundle: text_encoder: files: sha256" in err
    golden.unlink()
    err = _fails(b, capsys)
    assert "text_encoder: files:" in err and "missing" in err


def test_io_and_manifest_mismatches_name_the_check(bundle, tmp_path, capsys):
    b = _copy(bundle, tmp_path)
    mpath = b / "manifest.json"
    man = json.loads(mpath.read_text())
    man["components"]["text_encoder"]["inputs"][0]["dtype"] = "int64"  # the .tflite takes int32
    mpath.write_text(json.dumps(man))
    err = _fails(b, capsys, "--no-run")
    assert "verify-bundle: text_encoder: io:" in err and "signature check" in err
    man["components"]["text_encoder"]["inputs"][0].update(dtype="int32", shape=[2, 77])
    mpath.write_text(json.dumps(man))
    err = _fails(b, capsys, "--no-run")
    assert "verify-bundle: text_encoder: manifest: components.text_encoder.inputs.input_ids: shape [2, 77]" in err
    del man["scheduler"]
    mpath.write_text(json.dumps(man))
    assert "verify-bundle: manifest: manifest: scheduler" in _fails(b, capsys)
    assert "not in the bundle" in _fails(bundle, capsys, "--components", "unet")


def test_parity_failure_names_the_threshold(bundle, tmp_path, capsys):
    b = _copy(bundle, tmp_path)
    golden = b / "golden" / "text_encoder.npz"
    data = dict(np.load(golden))
    rng = np.random.default_rng(0)
    data["output_0"] = data["output_0"] + 0.5 * rng.standard_normal(data["output_0"].shape).astype(np.float32)
    np.savez(golden, **data)
    from pocketdiff.runtime.tflite_file import sha256_file

    man = json.loads((b / "manifest.json").read_text())
    man["components"]["text_encoder"]["golden"]["sha256"] = sha256_file(golden)
    (b / "manifest.json").write_text(json.dumps(man))
    err = _fails(b, capsys)
    assert "verify-bundle: text_encoder: parity: fp32 cosine" in err and "parity.fp32.cosine_min" in err


def test_device_profile_reports_and_enforces_budgets(bundle):
    from pocketdiff.errors import ConfigError, PocketdiffError
    from pocketdiff.export.device_profile import DeviceProfile, check_component

    path = bundle / "text_encoder.tflite"
    phone = check_component("text_encoder", path, DeviceProfile("phone"))
    assert phone["over_budget"] == [] and phone["budgets"] == {"max_tensor_mb": 64.0, "conv_input_mb": 3.5, "fc_input_mb": 2.0}
    assert phone["largest_tensor_mb"] > 0 and phone["largest_tensor_shape"]
    # the text encoder's 1x1 convs (its Linear layers) take its widest activations: well under Choi et al.'s 3.75 MB
    assert 0 < phone["largest_conv_input_mb"] <= phone["largest_tensor_mb"] and phone["largest_conv_input"].startswith("CONV_2D")
    assert phone["convs_over_conv_input_mb"] == 0
    assert phone["largest_fc_input_mb"] == 0 and phone["largest_fc_input"] == ""  # rewrites.linear_to_conv left no FULLY_CONNECTED
    tight = DeviceProfile("phone", max_tensor_mb=phone["largest_tensor_mb"] / 2)
    assert "device_profile.max_tensor_mb" in check_component("text_encoder", path, tight)["over_budget"][0]
    # a conv input budget under the largest conv input: over, with the count and the rewrite that serializes them
    conv = check_component("text_encoder", path, DeviceProfile("phone", conv_input_mb=phone["largest_conv_input_mb"] / 2))
    assert conv["convs_over_conv_input_mb"] >= 1
    assert "device_profile.conv_input_mb" in conv["over_budget"][0] and "conv_budget_scope: input" in conv["over_budget"][0]
    with pytest.raises(PocketdiffError, match="text_encoder: over the 'phone' device profile: largest tensor"):
        check_component("text_encoder", path, DeviceProfile("phone", max_tensor_mb=phone["largest_tensor_mb"] / 2, enforce=True))
    with pytest.raises(ConfigError, match="device_profile.name"):
        DeviceProfile("watch")


def test_cpu_runs_int8_as_its_fp16_variant(bundle, tmp_path):
    from pocketdiff.runtime.cpu_variant import fp16_variant
    from pocketdiff.runtime.tflite_file import TfliteModel

    src = bundle / "text_encoder.tflite"
    assert any(t.type == 9 for t in TfliteModel(src).graph.tensors)  # INT8 constants in the bundle's file
    n = fp16_variant(src, tmp_path / "te.tflite")
    assert n > 0 and not any(t.type == 9 for t in TfliteModel(tmp_path / "te.tflite").graph.tensors)
    reports = {}
    for flag in ([], ["--cpu-int8-as-is"]):
        out = tmp_path / f"v{len(flag)}.json"
        assert cli_main(["verify-bundle", str(bundle), "--accelerator", "cpu", "--json", str(out), *flag]) == 0
        reports[bool(flag)] = json.loads(out.read_text())["components"]["text_encoder"]
    assert reports[False]["cpu_variant"]["tensors"] == n and "cpu_variant" not in reports[True]
    assert reports[False]["parity"]["fp32"]["cosine"] > 0.99999 and reports[True]["parity"]["fp32"]["cosine"] > 0.99999
