"""The UNet exported in chunks (`unet_chunks`): the split in torch, the config's checks, and one tiny
teacher exported whole and in four chunks (the first ends with a down block, so it names an alias) (int8 from an RTN checkpoint in compress's format), run through
run-bundle and verify-bundle on the lavapipe delegate and XNNPACK."""
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

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TEACHER = "pocketdiff:shapes-teacher"
CHUNKS = 4  # the tiny teacher's first chunk then ends with down_blocks.1 (an alias) and the mid block is a chunk alone
PROMPT = "a red circle"
LAYER_CHUNKS = 3  # unet_chunk_cut: layer: the tiny teacher's 9 stages in 3 chunks, cut inside up_blocks.0 (before its upsampler)


@pytest.fixture(scope="module")
def teacher_unet():
    from pocketdiff.export.components import UNetGraph, time_embedding_table
    from pocketdiff.models import ModelConfig, load_or_build

    pipe = load_or_build(ModelConfig(pretrained=TEACHER))
    unet = pipe.unet.eval()
    table = time_embedding_table(unet, 1000)
    graph = UNetGraph(unet, external_time_embedding=True)
    s = unet.config.sample_size
    gen = torch.Generator().manual_seed(0)
    inputs = {"sample": torch.randn(2, unet.config.in_channels, s, s, generator=gen), "timestep": torch.from_numpy(table[[500, 500]]),
              "encoder_hidden_states": torch.randn(2, 77, pipe.text_encoder.config.hidden_size, generator=gen)}
    with torch.no_grad():
        ref = graph(*inputs.values())
    return unet, inputs, ref


@pytest.mark.parametrize("k, cut", [(1, "block"), (2, "block"), (3, "block"), (4, "block"), (5, "block"),
                                    (2, "layer"), (5, "layer"), (7, "layer"), (9, "layer")])
def test_chunks_in_sequence_equal_the_whole_unet_in_torch(teacher_unet, k, cut):
    from pocketdiff.export.unet_chunks import run_chunks, split_unet, unet_stages

    unet, inputs, ref = teacher_unet
    chunks = split_unet(unet, k, cut)
    _, outs, final = run_chunks(chunks, inputs)
    assert len(chunks) == k and [s for c in chunks for s in c.plan.stages] == [s.name for s in unet_stages(unet, cut)]
    assert torch.equal(final, ref)
    for i, (c, out) in enumerate(zip(chunks, outs)):  # every skip a chunk reads was made by one earlier chunk; none made for nobody
        assert set(out) == set(c.plan.outputs) and ("hidden" in out) == (i < k - 1)
        assert len({id(v) for v in out.values()}) == len(out)  # each tensor returned once (a converter would merge them)
        for n in (n for n in c.plan.inputs if n.startswith("skip_")):
            assert sum(n in d.plan.outputs or n in d.plan.aliases for d in chunks[:i]) == 1, (i, n)
        for n in (n for n in [*c.plan.outputs, *c.plan.aliases] if n.startswith("skip_")):
            assert any(n in d.plan.inputs for d in chunks[i + 1:]), (i, n)


def test_a_chunk_ending_with_a_down_block_returns_its_last_skip_as_hidden_once(teacher_unet):
    """SD's 3 chunks cut after down_blocks.3; the tiny teacher's 4 after down_blocks.1, whose last skip is its output."""
    from pocketdiff.export.unet_chunks import plan_chunks

    first = plan_chunks(teacher_unet[0], 4)[0]
    assert first.stages[-1] == "down_blocks.1" and first.aliases == {"skip_3": "hidden"}
    assert "skip_3" not in first.outputs and first.outputs[0] == "hidden"
    assert all(not p.aliases for p in plan_chunks(teacher_unet[0], 2))  # cut after mid_block: nothing to alias


def test_a_tensor_the_converter_returns_under_two_names_is_refused(tmp_path):
    """What SD's first chunk was before aliases: two signature names, one tensor; export and the runners refuse it."""
    from torch import nn

    from pocketdiff.export.exporter import convert_job
    from pocketdiff.runtime.manifest_check import BundleCheckError, check_component_io, tflite_io

    class Twice(nn.Module):
        def forward(self, x):
            y = torch.relu(x) * 2.0
            return {"hidden": y, "skip_3": y}

    path = tmp_path / "twice.tflite"
    convert_job(Twice().eval(), {"x": torch.randn(1, 4)}, path)
    assert tflite_io(path)["shared_outputs"] == [["hidden", "skip_3"]]
    entry = {"inputs": [{"name": "x", "shape": [1, 4], "dtype": "float32"}],
             "outputs": [{"name": n, "shape": [1, 4], "dtype": "float32"} for n in ("hidden", "skip_3")]}
    with pytest.raises(BundleCheckError, match="outputs hidden and skip_3 are one tensor"):
        check_component_io("unet.0", entry, path)


def test_bounds_minimise_the_heaviest_chunk():
    import itertools

    from pocketdiff.export.unet_chunks import balanced_bounds

    assert balanced_bounds([9, 1, 1, 1, 1], 2) == [(0, 1), (1, 5)]
    assert balanced_bounds([1, 1, 1, 1, 1, 1], 3) == [(0, 2), (2, 4), (4, 6)]
    assert balanced_bounds([1, 5, 1, 1, 5, 1], 3) == [(0, 2), (2, 4), (4, 6)]
    with pytest.raises(PocketdiffError, match="unet_chunks: 6 chunks, but the UNet has 5 blocks"):
        balanced_bounds([1] * 5, 6)
    rng = np.random.default_rng(0)  # the search over every cut, which the dynamic programme replaces
    for _ in range(40):
        w, k = rng.integers(1, 9, rng.integers(1, 10)).tolist(), 0
        k = int(rng.integers(1, len(w) + 1))
        best = min(itertools.combinations(range(1, len(w)), k - 1), key=lambda cuts: (
            max(sums := [sum(w[a:b]) for a, b in zip((0, *cuts), (*cuts, len(w)))]), sum(x * x for x in sums)))
        edges = (0, *best, len(w))
        assert balanced_bounds(w, k) == list(zip(edges, edges[1:])), (w, k)


def test_layer_cuts_split_the_heaviest_block_into_its_layers(teacher_unet):
    from pocketdiff.export.unet_chunks import plan_chunks, unet_stages

    unet, _, _ = teacher_unet
    blocks, layers = unet_stages(unet), unet_stages(unet, "layer")
    assert sum(s.params for s in blocks) == sum(s.params for s in layers) == sum(p.numel() for p in unet.parameters()) - sum(
        p.numel() for n, p in unet.named_parameters() if n.startswith("time_embedding"))
    assert len(layers) > len(blocks) and "up_blocks.1.layers.0" in [s.name for s in layers] and "mid_block" in [s.name for s in layers]
    k = len(blocks)
    assert max(p.params for p in plan_chunks(unet, k, "layer")) < max(p.params for p in plan_chunks(unet, k))
    with pytest.raises(PocketdiffError, match="cut must be one of block, layer"):
        unet_stages(unet, "resnet")


@pytest.mark.parametrize("overrides,message", [
    (["unet_chunks=0"], "unet_chunks: must be an int from 1 to"),
    (["unet_chunks=2", "jobs=2"], "unet_chunks: converts the chunks one after another: needs jobs: 1"),
    (["unet_chunks=2", "components=[text_encoder,vae_decoder]"], "unet_chunks: splits the unet component"),
    (["unet_chunks=2", "rewrites.time_embedding_outside=false"], "unet_chunks: needs rewrites.time_embedding_outside"),
    (["unet_chunks=2", "unet_chunk_cut=resnet"], "unet_chunk_cut: must be one of block, layer"),
])
def test_config_refuses_chunks_it_cannot_make(export_config_error, overrides, message):
    assert message in export_config_error(overrides)


@pytest.fixture(scope="module")
def bundles(teacher_int8_bundle, int8_checkpoint, shared_conversions, tmp_path_factory):
    """The whole UNet's bundle is tests/export/conftest.py's session export (test_bundle.py's); the chunked ones are
    exported here from the same config (no fp16 scan: it changes no graph). Their text encoder and decoder are the
    whole bundle's graphs: converted once (`shared_conversions`); each bundle stores, checks and lists its own."""
    root = tmp_path_factory.mktemp("chunks")
    cfg = {**teacher_int8_bundle["cfg"], "fp16_scan": {"enabled": False}}
    out = {"whole": teacher_int8_bundle["out"]}
    for name, extra in (("chunked", {"unet_chunks": CHUNKS}),
                        ("layered", {"unet_chunks": LAYER_CHUNKS, "unet_chunk_cut": "layer", "verify": {"delegate": False}})):
        (root / f"{name}.yaml").write_text(yaml.safe_dump({**cfg, **extra}))
        out[name] = root / f"bundle_{name}"
        with shared_conversions.of("text_encoder", "vae_decoder"):
            assert cli_main(["export", "--config", str(root / f"{name}.yaml"), "--output", str(out[name])]) == 0
    return {**out, "checkpoint": int8_checkpoint, "root": root, "report": json.loads((out["chunked"] / "report.json").read_text())}


def test_manifest_lists_the_chunks_with_parity_per_chunk_and_end_to_end(bundles):
    man = json.loads((bundles["chunked"] / "manifest.json").read_text())
    assert man["schema_version"] == 3 and json.loads((bundles["whole"] / "manifest.json").read_text())["schema_version"] == 3
    block = man["unet_chunks"]
    assert block["components"] == [f"unet.{k}" for k in range(CHUNKS)] and "unet" not in man["components"]
    assert block["aliases"] == [{"skip_3": "hidden"}, {}, {}, {}]
    assert [i["name"] for i in block["inputs"]] == ["sample", "timestep", "encoder_hidden_states"]
    assert [i["name"] for i in man["components"]["unet.1"]["inputs"]][0] == "hidden"
    assert [o["name"] for o in man["components"][f"unet.{CHUNKS - 1}"]["outputs"]] == ["out"]
    assert "skip_3" not in [o["name"] for o in man["components"]["unet.0"]["outputs"]]
    rep = bundles["report"]["components"]
    for name in block["components"]:
        assert rep[name]["fully_accelerated"] is True and rep[name]["cosine"] >= 0.999, name
    e2e = rep["unet"]["details"]["end_to_end_parity"]
    assert e2e["fp16"]["cosine"] >= 0.999 and e2e["fp16"]["psnr_db"] >= 30 and e2e["fp32"]["psnr_db"] >= 60, e2e
    assert e2e == block["parity"]


def test_int8_codes_in_every_chunk_equal_the_checkpoint_bit_for_bit(bundles):
    from pocketdiff.compress.quant.int8_format import load_quantized
    from pocketdiff.runtime.tflite_file import TfliteModel

    state, recipe = load_quantized(bundles["checkpoint"])
    carried: dict = {}
    for k in range(CHUNKS):
        tensors = TfliteModel(bundles["chunked"] / f"unet.{k}.tflite").int8_weights()
        mapping = json.loads((bundles["chunked"] / "_export" / f"unet.{k}_int8_map.json").read_text())
        assert not set(mapping) & set(carried)  # each layer lives in one chunk
        for layer, places in mapping.items():
            for p in places:
                got, (r0, r1), (c0, c1) = tensors[p["tensor"]]["codes"], p["rows"], p["cols"]
                got = got.transpose(0, 3, 1, 2) if p["layout"] == "ohwi" else got
                assert got.dtype == np.int8 and np.array_equal(got, state[f"{layer}.weight"][r0:r1, c0:c1].numpy().reshape(got.shape)), layer
            carried[layer] = places
    assert set(carried) == {n for n in recipe.layers if not n.startswith("time_embedding.")}


def _run(bundle: Path, out: Path, *flags: str) -> dict:
    assert cli_main(["run-bundle", str(bundle), "--prompt", PROMPT, "--output", str(out), "--seed", "1", *flags]) == 0
    return json.loads((out / "report.json").read_text())


def _image(report: dict) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(report["image"]), dtype=np.float64) / 255.0


def test_chunked_image_equals_the_whole_unets(bundles, tmp_path, monkeypatch):
    """GPU (lavapipe): chunked plain and pipelined against the whole UNet's image, the existing bundle-vs-reference
    tolerance (cosine 0.999, 30 dB); CPU: chunked against whole within 8-bit rounding."""
    from pocketdiff.runtime.parity import metrics

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    whole = _image(_run(bundles["whole"], tmp_path / "whole"))
    for flags in ((), ("--pipelined",)):
        m = metrics(whole, _image(_run(bundles["chunked"], tmp_path / f"chunked{len(flags)}", *flags)))
        assert m["cosine"] >= 0.999 and m["psnr_db"] >= 30, (flags, m)
    cpu = [_image(_run(bundles[b], tmp_path / f"cpu_{b}", "--accelerator", "cpu")) for b in ("whole", "chunked")]
    assert np.abs(cpu[0] - cpu[1]).max() <= 1 / 255


def test_layer_cut_chunks_export_and_run_as_the_whole_unet(bundles, tmp_path, monkeypatch):
    """Chunks cut inside blocks (unet_chunk_cut: layer; exported without the delegate checks, which the block
    cut's bundle runs): run-bundle on the lavapipe delegate, chunks kept and streamed, fully accelerated and with
    the whole UNet's image."""
    from pocketdiff.runtime.parity import metrics

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    man = json.loads((bundles["layered"] / "manifest.json").read_text())
    stages = man["unet_chunks"]["stages"]
    assert len(stages) == LAYER_CHUNKS and any(".layers." in n for c in stages for n in c)
    whole = _image(_run(bundles["whole"], tmp_path / "whole"))
    for flags in (("--pipelined",), ("--pipelined", "--stream-unet")):
        rep = _run(bundles["layered"], tmp_path / f"layered{len(flags)}", *flags)
        assert rep["fully_accelerated"] is True and set(rep["fully_accelerated_by_component"]) >= set(man["unet_chunks"]["components"])
        m = metrics(whole, _image(rep))
        assert m["cosine"] >= 0.999 and m["psnr_db"] >= 30, (flags, m)


def test_pipelined_compiles_one_chunk_at_a_time_and_keeps_them_for_every_step(bundles, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    rep = _run(bundles["chunked"], tmp_path / "pipe", "--pipelined")
    phases = [(p["component"], p["phase"]) for p in rep["memory"]["phases"]]
    opened = [i for i, (_, ph) in enumerate(phases) if ph == "opened"]
    for i in opened:  # a model's compile ends before the next model opens
        assert phases[i + 1] == (phases[i][0], "compiled"), phases
    chunks = [f"unet.{k}" for k in range(CHUNKS)]
    assert [c for c, ph in phases if ph == "compiled" and c in chunks] == chunks
    # each chunk settled (one run on zeros, the accelerator's host copies let go) before the next one opens
    assert phases.index(("unet.0", "compiled")) < phases.index(("unet.0", "settled")) < phases.index(("unet.1", "opened"))
    first_runs = [phases.index((c, "first_run")) for c in chunks]
    assert max(phases.index((c, "compiled")) for c in chunks) < min(first_runs)  # all resident before the first step
    assert all(phases.index((c, "released")) > phases.index((chunks[-1], "steady_run")) for c in chunks)
    assert set(rep["memory"]["gpu_cache"]["hits"]) >= set(chunks)  # the program cache keyed per chunk
    assert rep["fully_accelerated"] is True and set(rep["fully_accelerated_by_component"]) >= set(chunks)


def test_streamed_chunks_load_for_every_step_one_at_a_time_and_give_the_same_image(bundles, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    kept = _run(bundles["chunked"], tmp_path / "kept", "--pipelined")
    rep = _run(bundles["chunked"], tmp_path / "streamed", "--pipelined", "--stream-unet")
    assert rep["stream_unet"] is True and np.array_equal(_image(rep), _image(kept))
    phases = [(p["component"], p["phase"]) for p in rep["memory"]["phases"]]
    chunks, steps = [f"unet.{k}" for k in range(CHUNKS)], rep["steps"]
    for c in chunks:  # loaded and released once per step
        assert phases.count((c, "compiled")) == phases.count((c, "released")) == steps, (c, phases)
    unet = [(c, ph) for c, ph in phases if c in chunks and ph in ("opened", "released")]
    assert all(a[0] == b[0] and (a[1], b[1]) == ("opened", "released") for a, b in zip(unet[::2], unet[1::2])), unet  # one at a time
    assert rep["latency_s"]["unet_streamed_loads"] > 0
    for c in chunks:  # each chunk's runs are marked while it is loaded (its memory then), before its release
        assert phases.index((c, "first_run")) < phases.index((c, "released")), (c, phases)


@pytest.mark.parametrize("bundle, flags, message", [
    ("chunked", ("--stream-unet",), "needs --pipelined"),
    ("whole", ("--pipelined", "--stream-unet"), "export with unet_chunks=N"),
])
def test_stream_unet_refuses_what_it_cannot_stream(bundles, tmp_path, capsys, bundle, flags, message):
    out = tmp_path / "out"
    assert cli_main(["run-bundle", str(bundles[bundle]), "--prompt", PROMPT, "--output", str(out), *flags]) == 2
    assert message in capsys.readouterr().err and not out.exists()


def test_verify_bundle_checks_each_chunk_and_the_chain(bundles, tmp_path):
    assert cli_main(["verify-bundle", str(bundles["chunked"]), "--json", str(tmp_path / "v.json")]) == 0
    comps = json.loads((tmp_path / "v.json").read_text())["components"]
    assert {"unet.0", f"unet.{CHUNKS - 1}", "unet"} <= set(comps) and all(c["ok"] for c in comps.values())
    assert comps["unet"]["checks"] == ["chain", "finite", "parity"] and comps["unet"]["parity"]["fp16"]["psnr_db"] >= 30


def _broken(bundles, tmp_path: Path, name: str, edit) -> Path:
    b = tmp_path / name
    shutil.copytree(bundles["chunked"], b, ignore=shutil.ignore_patterns("_export"))
    man = json.loads((b / "manifest.json").read_text())
    edit(b, man)
    (b / "manifest.json").write_text(json.dumps(man))
    return b


@pytest.mark.parametrize("name,edit,message", [
    ("missing-file", lambda b, m: (b / "unet.1.tflite").unlink(), "unet.1.tflite is missing"),
    ("missing-entry", lambda b, m: m["components"].pop("unet.1"), "components.unet.1: missing"),
    ("version-1", lambda b, m: m.update(schema_version=1), "schema version 1 cannot hold unet_chunks"),
    ("shape", lambda b, m: m["components"]["unet.1"]["inputs"][0].update(shape=[2, 1, 1, 1]), "components.unet.1.inputs"),
    ("order", lambda b, m: m["unet_chunks"].update(components=["unet.1", "unet.0", "unet.2", "unet.3"]),
     "unet_chunks.components: must list unet.0, unet.1"),
    ("no-alias", lambda b, m: m["unet_chunks"].pop("aliases"), "components.unet.2.inputs.skip_3"),
    ("bad-alias", lambda b, m: m["unet_chunks"]["aliases"][0].update(skip_3="nothing"), "unet_chunks.aliases.0.skip_3: names nothing"),
])
def test_run_bundle_refuses_a_broken_chunked_manifest_naming_the_file(bundles, tmp_path, capsys, name, edit, message):
    b = _broken(bundles, tmp_path, name, edit)
    assert cli_main(["run-bundle", str(b), "--prompt", "x", "--output", str(tmp_path / "o"), "--accelerator", "cpu"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
