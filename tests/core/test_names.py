"""One name per concept (pocketdiff/names.py): the old names are accepted in configs, each with one
deprecation line naming old and new, and the config holds the new name."""
from __future__ import annotations

import pytest

from pocketdiff.config import load_config


def _warnings(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning")]


def _yaml(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_evaluate_takes_embedded_and_fp16_and_the_old_names_with_one_line_each(tmp_path, capsys):
    from pocketdiff.evaluate.run import Config

    cfg = load_config(Config, _yaml(tmp_path, "dtype: float16\nmodels:\n  - {build: tiny, guidance_mode: w_conditioned}\n"
                                              "  - {build: tiny, guidance_mode: w_conditioned}\n"))
    assert cfg.dtype == "fp16" and [m.guidance_mode for m in cfg.models] == ["embedded", "embedded"]
    said = _warnings(capsys)
    assert len([s for s in said if "w_conditioned" in s]) == 1 and any("models.guidance_mode: embedded" in s for s in said)
    assert len([s for s in said if "float16" in s and "dtype: fp16" in s]) == 1
    assert load_config(Config, _yaml(tmp_path, "models: [{build: tiny}]\n"), ["dtype=bf16"]).dtype == "bf16"


def test_calibrate_components_are_a_list_and_the_old_bools_still_work(tmp_path, capsys):
    from pocketdiff.compress.quant.calibrate_config import Config

    cfg = load_config(Config, _yaml(tmp_path, "quant: {text_encoder: true, vae_decoder: false}\n"))
    assert cfg.quant.components == ["unet", "text_encoder"] and cfg.quant.text_encoder is None
    said = _warnings(capsys)
    assert "warning: quant.text_encoder: true is deprecated, use quant.components: [unet, text_encoder]" in said
    assert load_config(Config, None, ["quant.components=[unet,vae_decoder]"]).quant.components == ["unet", "vae_decoder"]
    with pytest.raises(Exception, match="quant.components"):
        load_config(Config, None, ["quant.components=[unet,vae]"])


def test_a_memory_cap_is_off_at_null_and_0_is_the_old_off(tmp_path, capsys):
    from pocketdiff.train.loop import LoopConfig

    assert LoopConfig().memory_cap_gib is None
    assert load_config(LoopConfig, None, ["memory_cap_gib=0"]).memory_cap_gib is None
    assert any("train.memory_cap_gib: 0 is deprecated" in s for s in _warnings(capsys))
    assert load_config(LoopConfig, None, ["memory_cap_gib=24"]).memory_cap_gib == 24
    with pytest.raises(Exception, match="train.memory_cap_gib"):
        load_config(LoopConfig, None, ["memory_cap_gib=-1"])


def test_prediction_types_are_defined_once():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    defined = [p for folder in ("pocketdiff", "export", "runtime", "train", "evaluate", "compress")
               for p in (root / folder).rglob("*.py")
               if re.search(r"^PREDICTION_TYPES\s*=", p.read_text(), re.M)]
    assert [p.name for p in defined] == ["names.py"]
