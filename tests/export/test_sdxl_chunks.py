"""An SDXL-family UNet in chunks (issue 63: `unet_chunks` > 1 with SDXL's text_time added embedding). unet.0 takes
`text_embeds` and `time_ids` besides the time-embedding table's row, computes the added embedding in its graph and
returns `emb` (the row plus it); later chunks take `emb` in place of `timestep` (export/unet_chunks.py, runtime/BUNDLE.md).

In torch, on the tiny SDXL UNet (tests/tiny_sdxl.py): the chunks in sequence against the whole graph (the same
modules: equal) and against diffusers' UNet2DConditionModel with its own time embedding (max |diff| within
export's COMPOSE_TOLERANCE of the output's range). The tiny SDXL folder exported with its UNet in 2 (block cut) and 3
(layer cut) chunks (tests/conftest.py `sdxl_chunked_bundles`; every chunk fully accelerated and checked on the
lavapipe delegate at export): run-bundle's image against diffusers' StableDiffusionXLPipeline at the whole bundle's
thresholds (tests/export/test_sdxl_bundle.py: CPU >= 50 dB, GPU >= 40 dB), pipelined too; verify-bundle on both
accelerators; a chunk reading `emb` that no earlier chunk makes, or `text_embeds` no chunk reads, refused in one line."""
from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
import torch

from pocketdiff.errors import PocketdiffError
from tiny_sdxl import SDXL_CHUNKINGS, SDXL_PROMPT as PROMPT, SDXL_SCALE as SCALE, SDXL_STEPS as STEPS, xl_cond, xl_unet

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SEED = 3


@pytest.fixture(scope="module")
def xl():
    """The tiny SDXL UNet, its graph with the time embedding fed from the table, the graph's inputs, and diffusers'
    output on the same conditioning (its own time embedding)."""
    from pocketdiff.export.components import UNetGraph, time_embedding_table

    unet = xl_unet()
    cond = xl_cond(2, seed=1)
    gen = torch.Generator().manual_seed(0)
    sample, t = torch.randn(2, 4, 8, 8, generator=gen), [500, 500]
    table = time_embedding_table(unet, 1000)
    with torch.no_grad():
        ref = unet(sample, torch.tensor(t), cond.prompt_embeds, added_cond_kwargs={"text_embeds": cond.pooled_embeds,
                                                                                  "time_ids": cond.time_ids}).sample
    graph = UNetGraph(copy.deepcopy(unet), external_time_embedding=True)
    inputs = {"sample": sample, "timestep": torch.from_numpy(table[t]), "encoder_hidden_states": cond.prompt_embeds,
              "text_embeds": cond.pooled_embeds, "time_ids": cond.time_ids}
    with torch.no_grad():
        whole = graph(*inputs.values())
    return {"unet": unet, "graph": graph, "inputs": inputs, "whole": whole, "diffusers": ref}


@pytest.mark.parametrize("k, cut", [(1, "block"), (2, "block"), (3, "block"), (4, "block"), (2, "layer"), (3, "layer"), (6, "layer")])
def test_chunks_equal_the_whole_graph_and_diffusers_unet(xl, k, cut):
    from pocketdiff.export.chunk_export import COMPOSE_TOLERANCE
    from pocketdiff.export.unet_chunks import run_chunks, split_unet

    chunks = split_unet(xl["graph"].unet, k, cut)
    _, outs, final = run_chunks(chunks, xl["inputs"])
    assert torch.equal(final, xl["whole"])  # the same modules in the same order
    ref = xl["diffusers"]
    assert float((final - ref).abs().max()) <= COMPOSE_TOLERANCE * float(ref.abs().max())
    first, later = chunks[0].plan, [c.plan for c in chunks[1:]]
    assert first.inputs[:2] == ["sample", "timestep"] and first.inputs[-2:] == ["text_embeds", "time_ids"]
    assert (first.outputs[-1] == "emb") == (k > 1) and ("emb" in outs[0]) == (k > 1)
    for p in later:  # the summed embedding in place of the row; the added embedding's inputs read by unet.0 only
        assert "emb" in p.inputs and not {"timestep", "text_embeds", "time_ids", "emb"} & set(p.outputs)
        assert not {"timestep", "text_embeds", "time_ids"} & set(p.inputs)
    assert chunks[0].added is not None and all(c.added is None for c in chunks[1:])


def test_the_added_embedding_weights_count_in_the_first_chunk_only(xl):
    from pocketdiff.export.unet_chunks import plan_chunks, unet_stages

    unet = xl["unet"]
    outside = sum(p.numel() for n, p in unet.named_parameters() if n.startswith("time_embedding"))
    for cut in ("block", "layer"):
        assert sum(s.params for s in unet_stages(unet, cut)) == sum(p.numel() for p in unet.parameters()) - outside
    added = sum(p.numel() for p in unet.add_embedding.parameters())
    plans = plan_chunks(unet, 2)
    assert plans[0].params >= added + sum(p.numel() for p in unet.conv_in.parameters())


def test_other_added_embeddings_are_refused_in_one_line():
    from pocketdiff.export.unet_chunks import plan_chunks

    unet = xl_unet()
    unet.register_to_config(addition_embed_type="text")  # a text-only added embedding: not SDXL's
    with pytest.raises(PocketdiffError) as e:
        plan_chunks(unet, 2)
    msg = str(e.value)
    assert "\n" not in msg and "addition_embed_type 'text'" in msg and "carry 'text_time' only" in msg and "unet_chunks: 1" in msg


def test_a_chunk_missing_the_summed_embedding_is_named(xl):
    from pocketdiff.export.unet_chunks import run_chunks, split_unet

    chunks = split_unet(xl["graph"].unet, 2)
    chunks[0].plan.outputs.remove("emb")  # a first chunk that does not pass the added embedding on
    with pytest.raises(PocketdiffError) as e:
        run_chunks(chunks, xl["inputs"])
    msg = str(e.value)
    assert "\n" not in msg and "chunk 1 needs emb (the time embedding plus the added embedding of text_embeds and time_ids" in msg


# ------------------------------------------------------------------------------- the bundles


@pytest.fixture(scope="module")
def bundles(sdxl_bundle, sdxl_chunked_bundles):
    return {"folder": sdxl_bundle["folder"], "whole": sdxl_bundle["out"], **{k: sdxl_chunked_bundles[k] for k in SDXL_CHUNKINGS}}


@pytest.mark.parametrize("k", list(SDXL_CHUNKINGS))
def test_the_manifest_lists_the_chunks_and_their_added_embedding(bundles, k):
    man = json.loads((bundles[k] / "manifest.json").read_text())
    whole = json.loads((bundles["whole"] / "manifest.json").read_text())
    block, comps = man["unet_chunks"], man["components"]
    assert block["components"] == [f"unet.{i}" for i in range(k)] and "unet" not in comps
    assert block["inputs"] == whole["components"]["unet"]["inputs"]  # sample, timestep, states, text_embeds, time_ids
    assert man["pipeline"] == whole["pipeline"]  # the same stages and roles: the runners feed the chunks by name
    first = {i["name"]: i["shape"] for i in comps["unet.0"]["inputs"]}
    assert {"text_embeds", "time_ids", "timestep"} <= set(first) and "emb" not in first
    emb = next(o for o in comps["unet.0"]["outputs"] if o["name"] == "emb")
    assert emb["shape"] == first["timestep"]  # [B, width]: the row plus the added embedding
    for i in range(1, k):
        names = [x["name"] for x in comps[f"unet.{i}"]["inputs"]]
        assert "emb" in names and not {"timestep", "text_embeds", "time_ids"} & set(names)
    assert all(comps[n]["fully_accelerated"] for n in block["components"])
    report = json.loads((bundles[k] / "report.json").read_text())["components"]["unet"]["details"]
    assert report["end_to_end_parity"]["fp16"]["cosine"] >= 0.999 and report["chunks_rewrite_parity"]["cosine"] >= 0.9999


def _diffusers_image(folder, latents: np.ndarray) -> np.ndarray:
    from diffusers import StableDiffusionXLPipeline

    stock = StableDiffusionXLPipeline.from_pretrained(str(folder))
    stock.set_progress_bar_config(disable=True)
    return stock(PROMPT, num_inference_steps=STEPS, guidance_scale=SCALE, latents=torch.from_numpy(latents),
                 original_size=(32, 32), crops_coords_top_left=(0, 0), target_size=(32, 32), output_type="np").images[0]


def test_chunked_bundles_match_stock_sdxl_pipeline_and_the_whole_bundle(bundles):
    from pocketdiff.runtime.parity import metrics
    from pocketdiff.runtime.run_bundle import BundleRunner

    latents = np.random.default_rng(SEED).standard_normal((1, 4, 8, 8)).astype(np.float32)
    ref = _diffusers_image(bundles["folder"], latents)
    with BundleRunner(bundles["whole"], "cpu", gpu_cache=False) as runner:
        whole, _ = runner.run(PROMPT, seed=SEED, init_latents=latents)
    for k in SDXL_CHUNKINGS:  # the thresholds of tests/export/test_sdxl_bundle.py's whole UNet
        for accelerator, pipelined, psnr, cosine in (("cpu", False, 50.0, 0.9999), ("gpu", True, 40.0, 0.9995)):
            with BundleRunner(bundles[k], accelerator, pipelined=pipelined, gpu_cache=False) as runner:
                image, stats = runner.run(PROMPT, seed=SEED, init_latents=latents)
            m = metrics(ref, image)
            assert m["psnr_db"] >= psnr and m["cosine"] >= cosine, (k, accelerator, m)
            assert stats["finite"] and (accelerator == "cpu" or stats["fully_accelerated"])
            if accelerator == "cpu":  # the chunks compute the whole UNet's arithmetic
                assert metrics(whole, image)["psnr_db"] >= 60, k


@pytest.mark.parametrize("accelerator", ["cpu", "gpu"])
def test_verify_bundle_checks_each_chunk_and_the_chain(bundles, accelerator):
    from pocketdiff.runtime.verify_bundle import verify_bundle

    for k in SDXL_CHUNKINGS:
        result = verify_bundle(bundles[k], accelerator=accelerator)
        assert result["ok"] and all(c["ok"] for c in result["components"].values()), k
        assert {f"unet.{i}" for i in range(k)} | {"unet"} <= set(result["components"])


def _broken(bundles, tmp_path, edit):
    b = tmp_path / "bad"
    shutil.copytree(bundles[2], b)
    man = json.loads((b / "manifest.json").read_text())
    edit(man)
    (b / "manifest.json").write_text(json.dumps(man))
    return b, man


@pytest.mark.parametrize("edit, where, message", [
    (lambda m: m["components"]["unet.0"]["outputs"].pop(0 if m["components"]["unet.0"]["outputs"][0]["name"] == "emb" else -1),
     "components.unet.1.inputs.emb", "no earlier chunk (nor the unet's inputs) makes it: emb (the time embedding plus the added embedding"),
    (lambda m: [m["components"]["unet.0"]["inputs"].remove(i) for i in list(m["components"]["unet.0"]["inputs"]) if i["name"] == "text_embeds"],
     "unet_chunks.inputs.text_embeds", "no chunk reads it (the unet's added embedding is computed from text_embeds and time_ids in unet.0"),
])
def test_a_chunk_layout_without_the_added_embedding_is_refused_naming_it(bundles, tmp_path, capsys, edit, where, message):
    from pocketdiff.cli import main
    from pocketdiff.runtime.manifest_check import manifest_problems

    b, man = _broken(bundles, tmp_path, edit)
    lines = [f"{p.where}: {p.message}" for p in manifest_problems(b, man, files=False)]
    assert f"{where}: {message}" in "\n".join(lines), lines
    assert main(["run-bundle", str(b), "--prompt", "x", "--output", str(tmp_path / "o"), "--accelerator", "cpu"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and not ln.startswith(("INFO", "I0000", "W0000"))]
    assert len(err) == 1 and where in err[0], err
    assert not (tmp_path / "o").exists()
