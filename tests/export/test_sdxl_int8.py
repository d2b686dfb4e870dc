"""int8 weights for the SDXL family's second text encoder (issue 63 part 2, item 6): export's RTN quantizes
text_encoder_2 when int8.components names it (its graph holds int8 constants, golden parity as for the others), the
fp16 scan watches it, and naming it for a model without one is refused in one line before any conversion. The tiny
SDXL folder is tests/conftest.py's (sdxl_bundle); this export skips the delegate run (the lavapipe parity of the
same graphs at fp16 is test_sdxl_bundle.py's)."""
from __future__ import annotations

import json

import pytest
import yaml

from pocketdiff.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _export(root, pretrained, **extra) -> int:
    cfg = {"seed": 0, "model": {"pretrained": str(pretrained)}, "guidance": "cfg", "guidance_scale": 3.0, "steps": 2,
           "weights": "int8", "verify": {"delegate": False}, **extra}
    (root / "export.yaml").write_text(yaml.safe_dump(cfg))
    return main(["export", "--config", str(root / "export.yaml"), "--output", str(root / "bundle")])


def test_text_encoder_2_rtn_int8_and_the_scan(sdxl_bundle, tmp_path):
    code = _export(tmp_path, sdxl_bundle["folder"], int8={"rtn": True, "components": ["unet", "text_encoder", "text_encoder_2"]},
                   fp16_scan={"enabled": True, "prompts": ["a red circle"], "steps": 1})
    assert code == 0
    man = json.loads((tmp_path / "bundle" / "manifest.json").read_text())
    report = json.loads((tmp_path / "bundle" / "report.json").read_text())
    te2 = man["components"]["text_encoder_2"]
    assert te2["int8"]["layers"] and te2["int8"]["method"] == "rtn"
    assert report["components"]["text_encoder_2"]["weights"] == "int8"
    assert "text_encoder_2" in report["fp16_scan"]["components"]
    # the first encoder's graph returns the penultimate state: its last layer never runs, its codes stay outside
    outside = report["components"]["text_encoder"]["details"]["int8_layers_outside_graph"]
    assert outside and all("layers.1." in n for n in outside), outside
    assert report["components"]["text_encoder_2"]["details"]["int8_layers_outside_graph"] == []  # the pooled path runs it


def test_text_encoder_2_of_an_sd_model_is_refused_in_one_line(tmp_path, capsys):
    code = _export(tmp_path, "pocketdiff:shapes-teacher", int8={"rtn": True, "components": ["unet", "text_encoder_2"]})
    assert code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "int8.components: text_encoder_2: the model has no text_encoder_2" in err[0], err
    assert not (tmp_path / "bundle" / "manifest.json").exists()
