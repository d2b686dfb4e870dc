"""The page's tokenizer, sha256 and numpy readers (web/static/*.js) under node, against the
Python runner's tokenizer (run-bundle), hashlib and numpy."""
from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from pocketdiff.runtime.run_bundle import bundle_tokenize

STATIC = Path(__file__).resolve().parents[2] / "web" / "static"
HARNESS = Path(__file__).resolve().parent / "js_harness.mjs"

PROMPTS = [
    "a large red circle at the center",
    "",
    "A  Big\tRED   star!!",
    "don't stop, it's 3 o'clock; we'll see",
    "Crème brûlée 🍮 naïve CAFÉ",
    "numbers 12345 and x2y3",
    "hello.world,foo;bar...?!",
    "日本語のテキスト",
    "  leading and trailing  ",
    "a small blue square on a white background",
    " ".join(["a big purple hexagon on a gray background"] * 12),  # > 75 tokens: truncated
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A CLIP-format tokenizer with a few hundred merges, saved as export saves it (tokenizer.json)."""
    from pocketdiff.tokenizer import DEFAULT_CORPUS, build_clip_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    tok = build_clip_tokenizer(DEFAULT_CORPUS * 3, out_dir=folder / "src", vocab_size=1200)
    tok.backend_tokenizer.save(str(folder / "tokenizer.json"))
    meta = {"max_length": 77, "pad_id": int(tok.pad_token_id), "bos_id": int(tok.bos_token_id),
            "eos_id": int(tok.eos_token_id), "pad_token": str(tok.pad_token)}
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def _run(node: str, tmp_path: Path, request: dict) -> dict:
    req = tmp_path / "request.json"
    req.write_text(json.dumps(request))
    res = subprocess.run([node, str(HARNESS), str(STATIC), str(req)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)


def test_page_tokenizer_matches_run_bundle(node, tokenizer_dir, tmp_path):
    meta = json.loads((tokenizer_dir / "meta.json").read_text())
    tok_json = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    assert len(tok_json["model"]["merges"]) > 100  # BPE merging is really exercised
    out = _run(node, tmp_path, {"tokenizer_json": str(tokenizer_dir / "tokenizer.json"), "tokenizer": meta,
                                "prompts": PROMPTS, "files": [], "npy": [], "npz": []})
    for prompt, got in zip(PROMPTS, out["tokens"]):
        want = bundle_tokenize(tokenizer_dir / "tokenizer.json", prompt, meta).tolist()
        assert got["ids"] == want, prompt
    long = out["tokens"][-1]
    assert long["truncated"] == long["tokens"] - 75 > 0
    assert all(t["truncated"] == 0 for t in out["tokens"][:-1])


def test_page_sha256_and_numpy_readers(node, tmp_path):
    files = [tmp_path / "empty.bin", tmp_path / "abc.bin", tmp_path / "big.bin"]
    files[0].write_bytes(b"")
    files[1].write_bytes(b"abc")
    files[2].write_bytes(np.random.default_rng(0).bytes(200_003))
    table = np.random.default_rng(1).standard_normal((7, 5)).astype(np.float32)
    np.save(tmp_path / "table.npy", table)
    ids = np.arange(77, dtype=np.int64)[None]
    np.savez(tmp_path / "golden.npz", input_input_ids=ids, output_0=table.astype(np.float16), input_x=table.astype(np.float64))
    out = _run(node, tmp_path, {"tokenizer_json": str(STATIC.parents[1] / "pocketdiff/assets/shapes-teacher/tokenizer/tokenizer.json"),
                                "tokenizer": {"max_length": 77, "pad_id": 593, "bos_id": 592, "eos_id": 593}, "prompts": [],
                                "files": [str(f) for f in files], "npy": [str(tmp_path / "table.npy")], "npz": [str(tmp_path / "golden.npz")]})
    want = [hashlib.sha256(f.read_bytes()).hexdigest() for f in files]
    assert out["sha256"] == want
    assert out["sha256_subtle"] == want
    assert out["npy"][0]["shape"] == [7, 5]
    assert out["npy"][0]["sum"] == pytest.approx(float(table.sum()), rel=1e-5)
    assert out["npy"][0]["first"] == pytest.approx(float(table[0, 0]))
    z = out["npz"][0]
    assert z["input_input_ids"] == {"shape": [1, 77], "sum": int(ids.sum())}
    assert z["output_0"]["sum"] == pytest.approx(float(table.astype(np.float16).astype(np.float64).sum()), rel=1e-4)
    assert z["input_x"]["sum"] == pytest.approx(float(table.astype(np.float64).sum()), rel=1e-5)


TILE_CASES = [  # (height, width, tile, overlap, margin, factor)
    (8, 8, 6, 2, 1, 4),  # the tiled smoke bundle's: 2 x 2 tiles, the last overlapping more
    (8, 8, 8, 0, 0, 4),  # one tile
    (13, 21, 5, 2, 1, 2),  # uneven strides, the last tile shifted back
    (16, 12, [4, 12], 2, 1, 8),  # strips: [rows, columns]
    (20, 20, 8, 4, 2, 1),  # margin = overlap / 2: the weighted parts just meet
]


def _synthetic_one_pass(latents, tile, overlap, margin, factor):
    """numpy's one-pass decode with the harness's head (2 x latents) and up tile (nearest x factor
    of the first 3 channels + 0.01 x (row + column) in the tile)."""
    from pocketdiff.runtime.onepass_decode import one_pass_decode

    def up(t):
        th, tw = t.shape[-2:]
        base = np.kron(t[:, :3], np.ones((factor, factor), dtype=np.float32))
        return base + 0.01 * np.add.outer(np.arange(th * factor), np.arange(tw * factor)).astype(np.float32)

    return one_pass_decode(latents, lambda z: 2 * z, up, tile, overlap, factor, margin)


def test_page_one_pass_tiling_matches_the_runner(node, tmp_path):
    from pocketdiff.runtime.onepass_decode import tile_hw
    from pocketdiff.runtime.tiled_decode import axis_weights, tile_starts

    rng = np.random.default_rng(0)
    cases = []
    for h, w, tile, overlap, margin, factor in TILE_CASES:
        lat = rng.standard_normal((1, 4, h, w)).astype(np.float32)
        cases.append({"height": h, "width": w, "tile": tile, "overlap": overlap, "margin": margin, "factor": factor,
                      "channels": 4, "latents": lat.ravel().tolist()})
    blocks = [{"scheme": "one_pass", "tile": 6, "overlap": 2, "margin": 1, "factor": 4, "passes": 1},
              {"scheme": "control_variate", "tile": 6, "overlap": 2, "margin": 1, "factor": 4, "passes": 3, "norms": [3, 2]},
              {"scheme": "one_pass", "tile": [6, 6, 6], "overlap": 2, "margin": 1, "factor": 4, "passes": 1},
              {"scheme": "plain", "tile": 6, "overlap": 2, "margin": 1, "factor": 4, "passes": 3, "norms": [3]},
              {"scheme": "plain", "tile": 6, "overlap": 2, "margin": 1, "factor": 4, "passes": 0, "norms": [3, 2]},
              {"scheme": "per_tile", "tile": 6, "overlap": 2, "margin": 1, "factor": 4, "passes": 1}]
    out = _run(node, tmp_path, {"tokenizer_json": str(STATIC.parents[1] / "pocketdiff/assets/shapes-teacher/tokenizer/tokenizer.json"),
                                "tokenizer": {"max_length": 77, "pad_id": 593, "bos_id": 592, "eos_id": 593}, "prompts": [],
                                "files": [], "npy": [], "npz": [], "tiles": cases, "blocks": blocks})
    for case, got in zip(cases, out["tiles"]):
        (th, tw), h, w = tile_hw(case["tile"]), case["height"], case["width"]
        ys, xs = tile_starts(h, th, case["overlap"]), tile_starts(w, tw, case["overlap"])
        assert (got["ys"], got["xs"]) == (ys, xs), case["tile"]
        np.testing.assert_allclose(got["wys"], axis_weights(ys, th, case["margin"]), rtol=0, atol=1e-15)
        np.testing.assert_allclose(got["wxs"], axis_weights(xs, tw, case["margin"]), rtol=0, atol=1e-15)
        assert got["origins"] == [[y, x] for y in ys for x in xs] and got["calls"] == len(ys) * len(xs)
        lat = np.asarray(case["latents"], dtype=np.float32).reshape(1, 4, h, w)
        want = _synthetic_one_pass(lat, case["tile"], case["overlap"], case["margin"], case["factor"])
        assert got["shape"] == list(want.shape)
        np.testing.assert_allclose(np.asarray(got["image"], dtype=np.float32).reshape(want.shape), want, rtol=0, atol=1e-5)
    assert len(out["tiles"][0]["origins"]) == 4 and len(out["tiles"][1]["origins"]) == 1
    ok, iterated, bad_tile, *refused = out["problems"]
    assert ok is None and iterated is None
    assert "tile must be an int or [rows, columns]" in bad_tile
    assert "vae_tiling.norms must be [K, G]" in refused[0] and "passes must be at least 1" in refused[1]
    assert "not one the page runs" in refused[2] and "one_pass, plain, control_variate" in refused[2]


def _synthetic_stats_up(K: int, factor: int):
    """The harness's up tile for statsDecode, in numpy (see js_harness.mjs)."""
    def up(features, weight, stats, own):
        x = features[0].astype(np.float64)
        F, t, _ = x.shape
        w, o, n = weight.astype(np.float64), float(own[0]), t * t
        sums = np.zeros((K, 5, F))
        for k in range(K):
            for g in range(F):
                v = x[g]
                m, q = v.mean(), (v * v).mean() - v.mean() ** 2
                sums[k, :, g] = [(w * v).sum() / n, (w * v * v).sum() / n, w.sum() / n, m, q]
                mean, var = o * m + stats[k, 0, g], (o * q + 1 - o) * stats[k, 1, g]
                x[g] = 0.5 * (v - mean) / np.sqrt(var + 1e-5) + 0.1 * (k + 1)
        pixels = np.kron(x[None, :3], np.ones((factor, factor)))
        return pixels.astype(np.float32), sums.astype(np.float32)
    return up


STATS_CASES = [  # (h, w, tile, overlap, margin, factor, scheme, passes)
    (10, 10, 6, 2, 1, 2, "control_variate", 3),
    (13, 9, 5, 2, 1, 2, "plain", 2),
    (8, 8, 8, 0, 0, 2, "control_variate", 2),  # one tile: its own statistics are the image's
]


def test_page_iterated_statistics_decode_matches_the_runner(node, tmp_path):
    from pocketdiff.runtime.tiled_decode import tiled_decode_with_stats

    rng, K, C = np.random.default_rng(1), 2, 4
    cases = [{"height": h, "width": w, "tile": t, "overlap": ov, "margin": m, "factor": f, "scheme": sc, "passes": ps, "K": K,
              "channels": C, "latents": rng.standard_normal((1, C, h, w)).astype(np.float32).ravel().tolist()}
             for h, w, t, ov, m, f, sc, ps in STATS_CASES]
    out = _run(node, tmp_path, {"tokenizer_json": str(STATIC.parents[1] / "pocketdiff/assets/shapes-teacher/tokenizer/tokenizer.json"),
                                "tokenizer": {"max_length": 77, "pad_id": 593, "bos_id": 592, "eos_id": 593}, "prompts": [],
                                "files": [], "npy": [], "npz": [], "stats_cases": cases})
    for case, got in zip(cases, out["stats_decodes"]):
        lat = np.asarray(case["latents"], dtype=np.float32).reshape(1, C, case["height"], case["width"])
        want = tiled_decode_with_stats(lat, lambda z: 2 * z, _synthetic_stats_up(K, case["factor"]), case["tile"], case["overlap"],
                                       case["factor"], (K, C), case["passes"], margin=case["margin"], scheme=case["scheme"])
        assert got["shape"] == list(want.shape)
        np.testing.assert_allclose(np.asarray(got["image"], dtype=np.float32).reshape(want.shape), want, rtol=0, atol=2e-4)
        n_tiles = len(tile_starts_of(case, "height")) * len(tile_starts_of(case, "width"))
        assert got["calls"] == case["passes"] * n_tiles
    one_tile = out["stats_decodes"][2]["image"]
    assert np.isfinite(one_tile).all()


def tile_starts_of(case: dict, axis: str) -> list:
    from pocketdiff.runtime.tiled_decode import tile_starts

    return tile_starts(case[axis], case["tile"], case["overlap"])


def _lcm_block(prediction_type: str, steps: int, clip=None) -> dict:
    from pocketdiff.scheduler_blocks import lcm_timesteps

    betas = np.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000) ** 2  # scaled_linear
    return {"type": "lcm", "prediction_type": prediction_type, "num_train_timesteps": 1000, "steps": steps,
            "timesteps": lcm_timesteps(1000, 10, steps), "alphas_cumprod": np.cumprod(1 - betas).tolist(),
            "original_inference_steps": 10, "timestep_scaling": 10.0, "sigma_data": 0.5, "clip_sample_range": clip}


def test_page_lcm_step_matches_the_runner(node, tmp_path):
    """lcm.js against runtime/lcm_step.py: grids, and whole 1- and 3-step loops through each side's scheduler
    interface (schedulers.js, runtime/schedulers.py) on a stand-in model fed numpy's noise (every prediction type,
    clipping); its scheduler problems by name."""
    from pocketdiff.scheduler_blocks import lcm_timesteps
    from pocketdiff.runtime.schedulers import sample_loop, scheduler_for

    grids = [[1000, 10, n] for n in range(1, 11)] + [[1000, 50, 4], [1000, 7, 3], [999, 4, 4]]
    runs, wants = [], []
    for i, (ptype, steps, clip) in enumerate([("epsilon", 1, None), ("epsilon", 3, None), ("v_prediction", 3, None), ("sample", 3, 1.5)]):
        block = _lcm_block(ptype, steps, clip)
        x = np.random.default_rng(i).standard_normal((1, 4, 3, 3)).astype(np.float32)
        rng = np.random.default_rng(100 + i)
        noise = np.random.default_rng(100 + i).standard_normal((steps - 1, *x.shape)).astype(np.float32) if steps > 1 else np.zeros(0)
        wants.append(sample_loop(scheduler_for(block), x, lambda z, t: (0.7 * z + 0.3 * t / 1000).astype(np.float32), rng))
        runs.append({"sched": block, "x": x.ravel().tolist(), "noise": noise.ravel().tolist(), "a": 0.7, "b": 0.3})
    good = _lcm_block("epsilon", 2)
    schedulers = [good, {**good, "type": "euler"}, {**good, "timesteps": [999, 500]}, {**good, "sigma_data": 0},
                  {**good, "prediction_type": "flow"}, {"type": "ddim"}, {"type": "ddim", "clip_sample_range": -1}]
    out = _run(node, tmp_path, {"tokenizer_json": str(STATIC.parents[1] / "pocketdiff/assets/shapes-teacher/tokenizer/tokenizer.json"),
                                "tokenizer": {"max_length": 77, "pad_id": 593, "bos_id": 592, "eos_id": 593}, "prompts": [],
                                "files": [], "npy": [], "npz": [], "lcm_grids": grids, "lcm_runs": runs, "schedulers": schedulers})
    assert out["lcm_grids"] == [lcm_timesteps(*g) for g in grids]
    for want, got in zip(wants, out["lcm_runs"]):
        np.testing.assert_allclose(np.asarray(got, np.float32).reshape(want.shape), want, rtol=1e-5, atol=1e-5)
    ok, euler, off_grid, sigma, ptype, ddim, ddim_clip = out["lcm_problems"]
    assert ok is None and ddim is None
    assert "scheduler.clip_sample_range" in ddim_clip
    assert '"euler"' in euler and "not supported by the page" in euler
    assert "scheduler.timesteps" in off_grid and "[999,499]" in off_grid
    assert "scheduler.sigma_data" in sigma and "scheduler.prediction_type" in ptype


def _plain_request(**more) -> dict:
    """A harness request that runs only what `more` asks for (the tokenizer and readers on nothing)."""
    return {"tokenizer_json": str(STATIC.parents[1] / "pocketdiff/assets/shapes-teacher/tokenizer/tokenizer.json"),
            "tokenizer": {"max_length": 77, "pad_id": 593, "bos_id": 592, "eos_id": 593}, "prompts": [],
            "files": [], "npy": [], "npz": [], **more}


def test_page_prepare_check_and_unet_layouts(node, tmp_path):
    """prepare.js: after a mark, the lines LiteRT.js printed, and the one saying XNNPACK could not prepare a
    model (what the page turns into an error naming the component); chunks.js: a whole UNet, chunks, and
    the manifest problems it names."""
    lines = ["INFO: Created TensorFlow Lite XNNPACK delegate for CPU.", "ERROR: failed to create XNNPACK runtime",
             "ERROR: Node number 1906 (TfLiteXNNPackDelegate) failed to prepare."]
    chunked = {"schema_version": 2, "unet_chunks": {"components": ["unet.0", "unet.1"]}}
    manifests = [{"schema_version": 1}, chunked, {"schema_version": 2}, {**chunked, "schema_version": 1},
                 {"schema_version": 2, "unet_chunks": {"components": ["unet.1", "unet.0"]}}]
    out = _run(node, tmp_path, _plain_request(console_lines=lines, layouts=[{"manifest": m, "base": "unet"} for m in manifests]))
    assert out["prepare_since"] == lines and out["prepare_later"] == []
    assert out["prepare_failure"] == "ERROR: failed to create XNNPACK runtime"
    whole, chunks, v2_whole, v1_chunks, unordered = out["layouts"]
    assert whole == {"problem": None, "parts": ["unet"], "layout": None}
    assert chunks == {"problem": None, "parts": ["unet.0", "unet.1"], "layout": None}
    assert "schema version 2 is not supported" in v2_whole["problem"] and v2_whole["layout"] == v2_whole["problem"]
    assert "(expected 1, or 2 with unet_chunks or text_encoder_chunks, or 3 with its pipeline block)" in v2_whole["problem"]
    assert "a bundle with unet_chunks has schema version 2, got 1" in v1_chunks["problem"]
    assert "unet_chunks.components must list unet.0, unet.1" in unordered["problem"]


def test_a_non_finite_output_at_half_precision_is_one_line_naming_the_model(node, tmp_path):
    """prepare.js halfPrecisionProblem: what generate.js throws when a model at fp16 returned NaN/Inf (SwiftShader's
    text encoder does), and nothing for finite outputs or at fp32."""
    outputs = [{"what": "text_encoder", "values": [0.5, "NaN", 1], "precision": "fp16"},
               {"what": "unet (step 2)", "values": [0, "-Infinity"], "precision": "fp16"},
               {"what": "vae_decoder", "values": [0, 1e4, -65504], "precision": "fp16"},
               {"what": "text_encoder", "values": ["NaN"], "precision": "fp32"}]
    out = _run(node, tmp_path, _plain_request(outputs=outputs))["half_precision"]
    assert out[0] == "text_encoder: NaN/Inf values at fp16 on this GPU (value 1 of 3); run it at fp32"
    assert out[1].startswith("unet (step 2): NaN/Inf values at fp16") and out[2:] == [None, None]


TE_CHUNKS = {"components": ["text_encoder.0", "text_encoder.1"]}


def test_text_encoder_layouts_name_their_own_block(node, tmp_path):
    """chunks.js on text_encoder_chunks: its chunks in order, the UNet's layout beside it, and its problems in
    the UNet's words with the text encoder's names; the whole manifest's layout reports either block's."""
    te_only = {"schema_version": 2, "text_encoder_chunks": TE_CHUNKS}
    both = {**te_only, "unet_chunks": {"components": ["unet.0", "unet.1", "unet.2"]}}
    cases = [(te_only, "text_encoder"), (te_only, "unet"), (both, "text_encoder"), (both, "unet"),
             ({"schema_version": 1}, "text_encoder"),
             ({"schema_version": 2, "text_encoder_chunks": {"components": ["text_encoder.1", "text_encoder.0"]}}, "text_encoder"),
             ({"schema_version": 2, "text_encoder_chunks": {"components": ["text_encoder.0"]}}, "text_encoder"),
             ({"schema_version": 2, "text_encoder_chunks": {"components": ["unet.0", "unet.1"]}}, "text_encoder"),
             ({**te_only, "schema_version": 1}, "text_encoder"),
             ({**both, "text_encoder_chunks": {"components": "text_encoder.0"}}, "unet")]
    out = _run(node, tmp_path, _plain_request(layouts=[{"manifest": m, "base": b} for m, b in cases]))
    te, unet_beside, both_te, both_unet, v1_whole, unordered, one, other_names, v1_chunks, bad_te_beside = out["layouts"]
    assert te == {"problem": None, "parts": ["text_encoder.0", "text_encoder.1"], "layout": None}
    assert unet_beside == {"problem": None, "parts": ["unet"], "layout": None}  # schema 2 for the text encoder's block
    assert both_te["parts"] == ["text_encoder.0", "text_encoder.1"] and both_te["layout"] is None
    assert both_unet["parts"] == ["unet.0", "unet.1", "unet.2"]
    assert v1_whole == {"problem": None, "parts": ["text_encoder"], "layout": None}
    for bad in (unordered, one, other_names):
        assert "manifest: text_encoder_chunks.components must list text_encoder.0, text_encoder.1, ... (at least two)" in bad["problem"], bad
        assert bad["parts"] is None and bad["layout"] == bad["problem"]
    assert '["text_encoder.1","text_encoder.0"]' in unordered["problem"] and '["unet.0","unet.1"]' in other_names["problem"]
    assert v1_chunks["problem"] == "manifest.json: a bundle with text_encoder_chunks has schema version 2, got 1 (or 3, with its pipeline block)"
    # the UNet's own block is fine, the manifest is not: the page refuses it for the text encoder's
    assert bad_te_beside["problem"] is None and "text_encoder_chunks.components must list" in bad_te_beside["layout"]


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("aliases,expect", [
    ([{"skip_1": "hidden"}, {}], 5.0),  # unet.0: hidden = 1 + 1 = 2; unet.1 reads hidden and skip_1 (= hidden): 2 + 2 + 1
    (None, "no earlier chunk (nor the UNet's inputs) makes its input skip_1"),
    ([{"skip_1": "nothing"}, {}], "unet_chunks.aliases names nothing"),
])
def test_run_unet_passes_tensors_by_name_and_alias(node, tmp_path, aliases, expect, streamed):
    """Resident chunks, and streamed ones (each compiled for its use and released right after, even on a failure)."""
    block = {"components": ["unet.0", "unet.1"], **({"aliases": aliases} if aliases is not None else {})}
    chain = {"streamed": streamed, "manifest": {"schema_version": 2, "unet_chunks": block},
             "parts": [{"name": "unet.0", "inputs": ["sample"], "outputs": ["hidden"]},
                       {"name": "unet.1", "inputs": ["hidden", "skip_1"], "outputs": ["out"]}]}
    got = _run(node, tmp_path, _plain_request(chunk_chain=chain))["chunk_chain"]
    if isinstance(expect, float):
        assert got.get("value") == expect, got
        assert got["opened"] == (["+unet.0", "-unet.0", "+unet.1", "-unet.1"] if streamed else [])
        assert got["compiles"] == ([1, 1] if streamed else None)
    else:
        assert expect in got["error"], got
        if streamed:  # the chunk that failed (named first in the error) was released all the same
            assert got["opened"] == ["+unet.0", "-unet.0", "+unet.1", "-unet.1"][:len(got["opened"])], got
            assert got["opened"][-1] == "-" + got["error"].split(":")[0], got


TE_PARTS = [{"name": "text_encoder.0", "inputs": ["input_ids"], "outputs": ["hidden"]},
            {"name": "text_encoder.1", "inputs": ["hidden"], "outputs": ["out"]}]


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("aliases,second_inputs,expect", [
    (None, ["hidden"], 3.0),  # text_encoder.0: hidden = 1 + 1; text_encoder.1: out = 2 + 1
    ([{"first": "hidden"}, {}], ["hidden", "first"], 5.0),  # 2 + 2 + 1
    (None, ["hidden", "skip_1"], "text_encoder.1: no earlier chunk (nor the text encoder's inputs) makes its input skip_1"),
    ([{"first": "nothing"}, {}], ["hidden"], "text_encoder.0: text_encoder_chunks.aliases names nothing, which it does not return"),
])
def test_run_parts_chains_text_encoder_chunks(node, tmp_path, aliases, second_inputs, expect, streamed):
    """runParts on a text_encoder_chunks block: the text encoder's input_ids in, its chunks' tensors by name and
    alias, its errors in its own words."""
    block = {**TE_CHUNKS, **({"aliases": aliases} if aliases is not None else {})}
    chain = {"streamed": streamed, "base": "text_encoder", "feeds": {"input_ids": 1},
             "manifest": {"schema_version": 2, "text_encoder_chunks": block},
             "parts": [TE_PARTS[0], {**TE_PARTS[1], "inputs": second_inputs}]}
    got = _run(node, tmp_path, _plain_request(chunk_chain=chain))["chunk_chain"]
    if isinstance(expect, float):
        assert got.get("value") == expect, got
        assert got["opened"] == (["+text_encoder.0", "-text_encoder.0", "+text_encoder.1", "-text_encoder.1"] if streamed else [])
    else:
        assert expect in got["error"], got


def test_text_encoder_chunks_run_on_both_prompts_one_chunk_at_a_time(node, tmp_path):
    """runPartsOnEach, as the page runs a chunked text encoder with classifier-free guidance: chunk k compiled,
    run on the prompt and on the empty prompt, released, then chunk k + 1; each prompt's tensors kept apart."""
    chain = {"base": "text_encoder", "log_runs": True, "feeds_list": [{"input_ids": 1}, {"input_ids": 10}],
             "manifest": {"schema_version": 2, "text_encoder_chunks": TE_CHUNKS}, "parts": TE_PARTS}
    got = _run(node, tmp_path, _plain_request(chunk_chain=chain))["chunk_chain"]
    assert got.get("values") == [3.0, 12.0], got  # (1 + 1) + 1 and (10 + 1) + 1
    assert got["opened"] == ["+text_encoder.0", "run:text_encoder.0", "run:text_encoder.0", "-text_encoder.0",
                             "+text_encoder.1", "run:text_encoder.1", "run:text_encoder.1", "-text_encoder.1"]
    assert got["compiles"] == [1, 1]


def test_whole_text_encoder_runs_on_each_prompt_and_a_failing_chunk_is_released(node, tmp_path):
    """A whole text encoder through the same path (its one model on each prompt); a chunk that fails on its
    input is released before the error reaches the page."""
    whole = {"base": "text_encoder", "log_runs": True, "feeds_list": [{"input_ids": 1}, {"input_ids": 10}],
             "manifest": {"schema_version": 1}, "parts": [{"name": "text_encoder", "inputs": ["input_ids"], "outputs": ["out"]}]}
    got = _run(node, tmp_path, _plain_request(chunk_chain=whole))["chunk_chain"]
    assert got.get("values") == [2.0, 11.0] and got["opened"] == ["+text_encoder", "-text_encoder"], got
    broken = {**whole, "manifest": {"schema_version": 2, "text_encoder_chunks": TE_CHUNKS},
              "parts": [TE_PARTS[0], {**TE_PARTS[1], "inputs": ["hidden", "mask"]}]}
    got = _run(node, tmp_path, _plain_request(chunk_chain=broken))["chunk_chain"]
    assert "text_encoder.1: no earlier chunk (nor the text encoder's inputs) makes its input mask" in got["error"], got
    assert got["opened"] == ["+text_encoder.0", "run:text_encoder.0", "run:text_encoder.0", "-text_encoder.0",
                             "+text_encoder.1", "-text_encoder.1"]


def test_golden_outputs_are_matched_by_name_not_position(node, tmp_path):
    """SD's unet.0 comes back from LiteRT.js in another order than its golden's output_J (the declared order)."""
    cases = [[["skip_0", "hidden", "skip_1"], ["hidden", "skip_0", "skip_1"]], [["hidden"], ["hidden"]], [["other"], ["hidden"]]]
    out = _run(node, tmp_path, {"tokenizer_json": str(STATIC.parents[1] / "pocketdiff/assets/shapes-teacher/tokenizer/tokenizer.json"),
                                "tokenizer": {"max_length": 77, "pad_id": 593, "bos_id": 592, "eos_id": 593}, "prompts": [],
                                "files": [], "npy": [], "npz": [], "golden_order": cases})
    reordered, same, unknown = out["golden_order"]
    assert reordered == [1, 0, 2] and same == [0]
    assert "output other is not among the manifest's declared outputs (hidden)" in unknown


def test_chunk_blocks_of_a_v3_manifest_are_accepted(node, tmp_path):
    """schema_version 3 (the manifest declares its pipeline, stages.js) holds a chunks block or none; other versions are
    refused as before, naming the versions the page reads."""
    te_chunks = {"schema_version": 3, "text_encoder_chunks": TE_CHUNKS, "pipeline": {}}
    cases = [({"schema_version": 3, "pipeline": {}}, "unet"), (te_chunks, "text_encoder"), (te_chunks, "unet"),
             ({"schema_version": 4}, "unet"), ({"schema_version": 4, "unet_chunks": {"components": ["unet.0", "unet.1"]}}, "unet")]
    out = _run(node, tmp_path, _plain_request(layouts=[{"manifest": m, "base": b} for m, b in cases]))["layouts"]
    assert out[0] == {"problem": None, "parts": ["unet"], "layout": None}
    assert out[1] == {"problem": None, "parts": ["text_encoder.0", "text_encoder.1"], "layout": None}
    assert out[2] == {"problem": None, "parts": ["unet"], "layout": None}
    assert out[3]["problem"] == ("manifest.json: schema version 4 is not supported (expected 1, or 2 with unet_chunks or "
                                 "text_encoder_chunks, or 3 with its pipeline block)")
    assert out[4]["problem"] == "manifest.json: a bundle with unet_chunks has schema version 2, got 4 (or 3, with its pipeline block)"
