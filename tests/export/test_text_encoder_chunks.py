"""The text encoder exported in chunks (`text_encoder_chunks`): the split in torch, the config's checks, and the
tiny teacher exported with its text encoder in two chunks (CFG: the chunks run on the prompt and the empty
prompt), through run-bundle (plain and pipelined, one chunk in memory at a time) and verify-bundle on the
lavapipe delegate."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from pocketdiff.cli import main as cli_main
from pocketdiff.errors import PocketdiffError

TEACHER = "pocketdiff:shapes-teacher"
PROMPT = "a red circle"
CHUNKS = 2  # the tiny teacher's text encoder has two layers


@pytest.fixture(scope="module")
def text_encoder():
    from pocketdiff.models import ModelConfig, load_or_build

    return load_or_build(ModelConfig(pretrained=TEACHER)).text_encoder.eval()


@pytest.mark.parametrize("k", [1, 2])
def test_chunks_in_sequence_equal_the_whole_text_encoder_in_torch(text_encoder, k):
    from pocketdiff.export.components import TextEncoderGraph
    from pocketdiff.export.text_encoder_chunks import split_text_encoder
    from pocketdiff.export.unet_chunks import run_chunks

    ids = torch.randint(0, 1000, (1, 77), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    with torch.no_grad():
        ref = TextEncoderGraph(text_encoder)(ids)
    chunks = split_text_encoder(text_encoder, k)
    feeds, outs, final = run_chunks(chunks, {"input_ids": ids})
    assert torch.equal(final, ref)
    assert chunks[0].plan.stages[0] == "embeddings" and chunks[-1].plan.stages[-1] == "final_layer_norm"
    assert [s for c in chunks for s in c.plan.stages if s.startswith("encoder.layers.")] == ["encoder.layers.0", "encoder.layers.1"]
    assert list(feeds[0]) == ["input_ids"] and all(list(f) == ["hidden"] for f in feeds[1:])
    assert list(outs[-1]) == ["out"] and all(list(o) == ["hidden"] for o in outs[:-1])


def test_more_chunks_than_layers_is_refused(text_encoder):
    from pocketdiff.export.text_encoder_chunks import split_text_encoder

    with pytest.raises(PocketdiffError, match="text_encoder_chunks: 3 chunks, but the text encoder has 2 layers"):
        split_text_encoder(text_encoder, 3)


def test_a_text_encoder_that_is_not_clip_is_refused():
    from pocketdiff.export.text_encoder_chunks import split_text_encoder

    with pytest.raises(PocketdiffError, match="Linear is not a CLIP text encoder"):
        split_text_encoder(torch.nn.Linear(2, 2), 2)


@pytest.mark.parametrize("overrides,message", [
    (["text_encoder_chunks=0"], "text_encoder_chunks: must be an int from 1 to"),
    (["text_encoder_chunks=2", "jobs=2"], "text_encoder_chunks: converts the chunks one after another: needs jobs: 1"),
    (["text_encoder_chunks=2", "components=[unet,vae_decoder]"], "text_encoder_chunks: splits the text_encoder component"),
])
def test_config_refuses_chunks_it_cannot_make(export_config_error, overrides, message):
    assert message in export_config_error(overrides)


@pytest.fixture(scope="module")
def bundle(gpu_delegate, shared_conversions, tmp_path_factory):
    """The teacher with its text encoder in chunks; its UNet and decoder are the graphs other bundles of the session
    convert too (their conversions shared: tests/conftest.py's `shared_conversions`)."""
    root = tmp_path_factory.mktemp("te_chunks")
    cfg = {"seed": 0, "model": {"pretrained": TEACHER}, "weights": "fp16", "guidance": "cfg", "guidance_scale": 3.0, "steps": 2,
           "fp16_scan": {"enabled": False}, "text_encoder_chunks": CHUNKS}
    (root / "export.yaml").write_text(yaml.safe_dump(cfg))
    with shared_conversions.of("vae_decoder", "unet"):
        assert cli_main(["export", "--config", str(root / "export.yaml"), "--output", str(root / "bundle")]) == 0
    return root / "bundle"


def test_manifest_lists_the_chunks_with_parity_per_chunk_and_end_to_end(bundle):
    man = json.loads((bundle / "manifest.json").read_text())
    block = man["text_encoder_chunks"]
    assert man["schema_version"] == 3 and "unet_chunks" not in man
    assert block["components"] == ["text_encoder.0", "text_encoder.1"] and "text_encoder" not in man["components"]
    assert [i["name"] for i in block["inputs"]] == ["input_ids"] and block["aliases"] == [{}, {}]
    assert [i["name"] for i in man["components"]["text_encoder.1"]["inputs"]] == ["hidden"]
    assert [o["name"] for o in man["components"]["text_encoder.1"]["outputs"]] == ["out"]
    rep = json.loads((bundle / "report.json").read_text())["components"]
    assert all(rep[n]["fully_accelerated"] is True and rep[n]["cosine"] >= 0.999 for n in block["components"])
    e2e = rep["text_encoder"]["details"]["end_to_end_parity"]
    assert e2e == block["parity"] and e2e["fp16"]["cosine"] >= 0.999 and e2e["fp32"]["psnr_db"] >= 60, e2e


def _run(bundle: Path, out: Path, *flags: str) -> dict:
    assert cli_main(["run-bundle", str(bundle), "--prompt", PROMPT, "--output", str(out), "--seed", "1", *flags]) == 0
    return json.loads((out / "report.json").read_text())


def test_the_runner_encodes_as_the_whole_text_encoder(bundle):
    """The chunks in sequence on the delegate give the whole torch text encoder's output (the block's golden)."""
    from pocketdiff.runtime.parity import metrics
    from pocketdiff.runtime.run_bundle import BundleRunner

    man = json.loads((bundle / "manifest.json").read_text())
    with np.load(bundle / man["text_encoder_chunks"]["golden"]["path"]) as g:
        ids, ref = g["input_input_ids"], g["output_0"]
    for pipelined in (False, True):
        with BundleRunner(bundle, pipelined=pipelined, gpu_cache=False) as runner:
            # the prompt's row only, as the golden holds it (the pipeline's encode stages, runtime/pipeline.py)
            m = metrics(ref, runner.pipeline.encode({"encode_prompt": [ids[0]]}, {})["prompt_embeds"])
        assert m["cosine"] >= 0.999 and m["psnr_db"] >= 30, (pipelined, m)


def test_pipelined_holds_one_text_encoder_chunk_at_a_time_and_gives_the_plain_image(bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    plain, pipe = _run(bundle, tmp_path / "plain"), _run(bundle, tmp_path / "pipe", "--pipelined")
    from PIL import Image

    assert np.array_equal(np.asarray(Image.open(plain["image"])), np.asarray(Image.open(pipe["image"])))
    phases = [(p["component"], p["phase"]) for p in pipe["memory"]["phases"]]
    for name in ("text_encoder.0", "text_encoder.1"):  # run on the prompt and the empty prompt, then released
        assert phases.index((name, "steady_run")) < phases.index((name, "released")), phases
    assert phases.index(("text_encoder.0", "released")) < phases.index(("text_encoder.1", "opened"))
    assert pipe["latency_s"]["text_encoder_load"] == pytest.approx(  # the report rounds each to 0.1 ms
        pipe["latency_s"]["text_encoder.0_load"] + pipe["latency_s"]["text_encoder.1_load"], abs=2e-4)
    assert pipe["fully_accelerated"] is True and {"text_encoder.0", "text_encoder.1"} <= set(pipe["fully_accelerated_by_component"])


def test_verify_bundle_checks_each_chunk_and_the_chain(bundle, tmp_path):
    assert cli_main(["verify-bundle", str(bundle), "--json", str(tmp_path / "v.json")]) == 0
    comps = json.loads((tmp_path / "v.json").read_text())["components"]
    assert {"text_encoder.0", "text_encoder.1", "text_encoder"} <= set(comps) and all(c["ok"] for c in comps.values())
    assert comps["text_encoder"]["checks"] == ["chain", "finite", "parity"]


@pytest.mark.parametrize("name,edit,message", [
    ("missing-entry", lambda m: m["components"].pop("text_encoder.1"), "components.text_encoder.1: missing"),
    ("order", lambda m: m["text_encoder_chunks"].update(components=["text_encoder.1", "text_encoder.0"]),
     "text_encoder_chunks.components: must list text_encoder.0, text_encoder.1"),
    ("no-block", lambda m: m.pop("text_encoder_chunks"), "a text_encoder chunk needs the manifest's text_encoder_chunks block"),
    ("shape", lambda m: m["components"]["text_encoder.1"]["inputs"][0].update(shape=[1, 7, 1]), "components.text_encoder.1.inputs.hidden"),
])
def test_run_bundle_refuses_a_broken_manifest_naming_the_field(bundle, tmp_path, capsys, name, edit, message):
    b = tmp_path / name
    shutil.copytree(bundle, b, ignore=shutil.ignore_patterns("_export"))
    man = json.loads((b / "manifest.json").read_text())
    edit(man)
    (b / "manifest.json").write_text(json.dumps(man))
    assert cli_main(["run-bundle", str(b), "--prompt", "x", "--output", str(tmp_path / "o"), "--accelerator", "cpu"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
