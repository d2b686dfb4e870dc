"""The manifest's pipeline block (runtime/pipeline_spec.py): the compatibility reader for bundles from before it,
the checks that name the stage, component and input at fault, and the runners refusing a bad block before any model
loads (exit 2, one line, nothing written)."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from pocketdiff.runtime.manifest_check import manifest_problems
from pocketdiff.runtime.pipeline_spec import PIPELINE_SCHEMA_VERSION, ROLES, derive_pipeline, pipeline_of, stage_parts

WEB = Path(__file__).resolve().parents[1] / "web"
SMOKES = sorted(p for p in WEB.glob("smoke_bundle*") if (p / "manifest.json").is_file())


def _manifest(name: str = "smoke_bundle") -> dict:
    return json.loads((WEB / name / "manifest.json").read_text())


@pytest.mark.parametrize("bundle", SMOKES, ids=lambda p: p.name)
def test_every_committed_bundle_reads_as_the_sd_pipeline_with_every_input_fed_by_a_known_role(bundle):
    man = json.loads((bundle / "manifest.json").read_text())
    assert "pipeline" not in man and man["schema_version"] in (1, 2)  # exported before the block: the reader derives it
    pipe = pipeline_of(man)
    assert [s["kind"] for s in pipe["stages"]] == ["encode_prompt", "denoise", "decode"]
    assert pipe["family"] == "sd" and pipe["tasks"] == ["text_to_image"]
    for stage in pipe["stages"]:
        assert all(role in ROLES for role in stage["inputs"].values()), stage
        assert stage_parts(man, stage["component"])  # its chunks or tiled parts, or itself
    denoise = pipe["stages"][1]["inputs"]
    assert denoise["timestep"] == ("timestep_embedding" if man.get("time_embedding") else "timestep")
    assert denoise["sample"] == "latents" and denoise["encoder_hidden_states"] == "prompt_embeds"
    assert manifest_problems(bundle, {**man, "pipeline": pipe, "schema_version": PIPELINE_SCHEMA_VERSION}, files=False) == []


def test_the_derived_block_names_a_chunked_models_whole_inputs_and_a_tiled_decoders_head():
    chunked = _manifest("smoke_bundle_tiny")
    stages = derive_pipeline(chunked)["stages"]
    assert stage_parts(chunked, "unet") == tuple(chunked["unet_chunks"]["components"])
    assert set(stages[1]["inputs"]) == {i["name"] for i in chunked["unet_chunks"]["inputs"]}
    tiled = _manifest("smoke_bundle_tiled_parts")
    assert stage_parts(tiled, "vae_decoder") == tuple(tiled["vae_tiling"]["components"])
    assert derive_pipeline(tiled)["stages"][2]["inputs"] == {"latents": "latents"}


def _with_pipeline(edit) -> dict:
    man = _manifest()
    man["pipeline"] = derive_pipeline(man)
    man["schema_version"] = PIPELINE_SCHEMA_VERSION
    edit(man)
    return man


BAD = [
    ("stage-names-a-missing-component", lambda m: m["pipeline"]["stages"][2].update(component="vae_decoder_head"),
     "pipeline.stages[2] (decode).component"),
    ("unknown-role", lambda m: m["pipeline"]["stages"][1]["inputs"].update(timestep="wall_clock"),
     "pipeline.stages[1] (denoise).inputs.timestep: component unet, input timestep: role 'wall_clock'"),
    ("unknown-kind", lambda m: m["pipeline"]["stages"][0].update(kind="encode_audio"), "pipeline.stages[0] (encode_prompt).kind"),
    ("role-not-made-yet", lambda m: m["pipeline"]["stages"][1]["inputs"].update(encoder_hidden_states="pooled_embeds"),
     "component unet, input encoder_hidden_states: no earlier stage or bundle field makes pooled_embeds"),
    ("time-ids-not-declared", lambda m: m["pipeline"]["stages"][1]["inputs"].update(encoder_hidden_states="time_ids"),
     "no earlier stage or bundle field makes time_ids"),
    ("input-fed-no-role", lambda m: m["pipeline"]["stages"][1]["inputs"].pop("timestep"),
     "component unet: input timestep is fed no role"),
    ("input-the-component-lacks", lambda m: m["pipeline"]["stages"][1]["inputs"].update(time_ids_2="timestep"),
     "component unet has no input time_ids_2"),
    ("shape-disagrees", lambda m: m["pipeline"]["stages"][1]["inputs"].update(encoder_hidden_states="timestep"),
     "components.unet.inputs.encoder_hidden_states"),
    ("no-decode", lambda m: m["pipeline"]["stages"].pop(), "one denoise stage then one decode stage"),
    ("tokenizer-block-missing", lambda m: m["pipeline"]["stages"][0].update(tokenizer="tokenizer_2"),
     "names 'tokenizer_2', which is no tokenizer block"),
]


@pytest.mark.parametrize("name,edit,message", BAD, ids=[b[0] for b in BAD])
def test_a_bad_pipeline_block_is_named_by_stage_component_and_input(name, edit, message):
    problems = manifest_problems(WEB / "smoke_bundle", _with_pipeline(edit), files=False)
    assert problems, name
    assert message in f"{problems[0].where}: {problems[0].message}", [f"{p.where}: {p.message}" for p in problems]


def _bad_bundle(tmp_path: Path, edit) -> Path:
    bundle = tmp_path / "bundle"
    shutil.copytree(WEB / "smoke_bundle", bundle)
    man = json.loads((bundle / "manifest.json").read_text())
    man["pipeline"] = derive_pipeline(man)
    man["schema_version"] = PIPELINE_SCHEMA_VERSION
    edit(man)
    (bundle / "manifest.json").write_text(json.dumps(man))
    return bundle


@pytest.mark.parametrize("verb", ["run-bundle", "verify-bundle"])
def test_the_runners_refuse_a_bad_stage_in_one_line_before_any_model_loads(verb, tmp_path, capsys):
    from pocketdiff.cli import main as cli_main

    bundle = _bad_bundle(tmp_path, lambda m: m["pipeline"]["stages"][1]["inputs"].update(timestep="wall_clock"))
    out = tmp_path / "out"
    args = ["--prompt", "a red circle", "--output", str(out), "--accelerator", "cpu"] if verb == "run-bundle" else ["--accelerator", "cpu", "--no-run"]
    assert cli_main([verb, str(bundle), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any("denoise" in line and "unet" in line and "timestep" in line and "wall_clock" in line for line in err), err
    assert not out.exists()


def test_a_version_3_manifest_without_its_block_and_an_old_one_with_it_are_refused_naming_the_version(tmp_path):
    from pocketdiff.errors import PocketdiffError
    from pocketdiff.runtime.bundle import load_manifest

    bundle = _bad_bundle(tmp_path, lambda m: m.pop("pipeline"))
    with pytest.raises(PocketdiffError, match="schema version 3 declares its pipeline"):
        load_manifest(bundle)
    old = _bad_bundle(tmp_path / "old", lambda m: m.update(schema_version=1))
    with pytest.raises(PocketdiffError, match="schema version 1 cannot hold a pipeline block"):
        load_manifest(old)
    future = _bad_bundle(tmp_path / "future", lambda m: m.update(schema_version=4))
    with pytest.raises(PocketdiffError, match="schema version 4 is not supported"):
        load_manifest(future)


def test_a_role_no_runner_feeds_is_refused_when_the_runner_is_made(tmp_path):
    from pocketdiff.errors import PocketdiffError
    from pocketdiff.runtime.pipeline import BundlePipeline

    man = _with_pipeline(lambda m: None)
    man["pipeline"]["stages"][1]["inputs"]["timestep"] = "guidance_embedding"
    with pytest.raises(PocketdiffError, match="input timestep: no runner feeds role guidance_embedding"):
        BundlePipeline(copy.deepcopy(man), "b")
