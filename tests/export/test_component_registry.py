"""The component registry (runtime/components.py): one table the exporter, the manifest check, int8 and
calibrate read; numpy- and torch-free so the runtime reads it too."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pocketdiff.runtime import components as reg

SMOKE = Path(__file__).resolve().parents[1] / "web"


def test_the_registry_imports_without_torch_or_numpy():
    code = ("import sys, pocketdiff.runtime.components as c; "
            "print(sorted(m for m in ('torch', 'numpy', 'diffusers') if m in sys.modules), c.COMPONENTS)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] ('text_encoder', 'unet', 'vae_decoder', 'vae_encoder')"


def test_the_derived_lists_come_from_the_entries():
    assert reg.CHUNKABLE == ("text_encoder", "unet")
    assert reg.TILED_DECODER == ("vae_decoder_head", "vae_up_tile")
    assert all(reg.REGISTRY[p].part_of == "vae_decoder" for p in reg.TILED_DECODER)
    assert reg.component("unet.3") is reg.REGISTRY["unet"] and reg.component("vae_up_tile").part_of == "vae_decoder"
    with pytest.raises(KeyError, match="controlnet"):
        reg.component("controlnet")
    assert reg.TASK_COMPONENTS == ("vae_encoder",) and reg.TEXT_TO_IMAGE_COMPONENTS == ("text_encoder", "unet", "vae_decoder")
    assert reg.expand(["text_encoder", "vae_decoder"], tiled=True) == ["text_encoder", "vae_decoder_head", "vae_up_tile"]
    assert reg.expand(["vae_decoder"], tiled=False) == ["vae_decoder"]
    assert reg.expand(["text_encoder", "vae_decoder"], tiled=True, up_parts=2) == ["text_encoder", "vae_decoder_head", "vae_up_tile.0", "vae_up_tile.1"]


def test_export_int8_calibrate_and_the_runtime_read_the_registry():
    from pocketdiff.compress.quant.calibrate_config import QUANTIZABLE
    from pocketdiff.export import components, int8, verb
    from pocketdiff.runtime import chunks, manifest_check

    assert components.COMPONENTS is reg.COMPONENTS and manifest_check.RUNNER_COMPONENTS is reg.COMPONENTS
    # calibrate and int8 take every whole component a stage may name (SDXL's text_encoder_2 too)
    assert QUANTIZABLE is reg.STAGE_COMPONENTS and verb.TILED_DECODER is reg.TILED_DECODER
    assert int8.GRAPH_PREFIX == {"text_encoder": "text_encoder.", "text_encoder_2": "text_encoder.", "unet": "unet.",
                                 "vae_decoder": "", "vae_encoder": ""}
    assert chunks.CHUNKABLE is reg.CHUNKABLE  # runtime/chunks.py reads the registry's


def test_the_manifest_check_names_an_input_the_registry_requires():
    from pocketdiff.runtime.manifest_check import manifest_problems

    man = json.loads((SMOKE / "smoke_bundle" / "manifest.json").read_text())
    assert manifest_problems(SMOKE / "smoke_bundle", man, files=False) == []
    broken = copy.deepcopy(man)
    broken["components"]["unet"]["inputs"] = [i for i in broken["components"]["unet"]["inputs"]
                                              if i["name"] != "encoder_hidden_states"]
    problems = manifest_problems(SMOKE / "smoke_bundle", broken, files=False)
    assert [p.where for p in problems] == ["components.unet.inputs"]
    assert "has no encoder_hidden_states" in problems[0].message


def test_an_unknown_component_in_an_export_config_is_one_line_naming_the_field():
    from pocketdiff.config import load_config
    from pocketdiff.errors import ConfigError
    from pocketdiff.export.verb import Config

    with pytest.raises(ConfigError, match=r"components: unknown component 'controlnet'"):
        load_config(Config, None, ["components=[unet,controlnet]"])
