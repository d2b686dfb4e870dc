"""benchmarks/lora_bundle.py measures LoRA slots against the plain UNet (issue 65 item 3): each layout in its own
process, per-step times and the memory ledger's phases, and the swaps run-bundle --lora makes (LoraFeeds.load of the
LoRA files it writes from the slots' shapes). On a toy UNet-like graph (one projection per slotted module, the slots'
input names as the exporter gives them), converted here whole and in two chunks (one module each, the factors fed to
each chunk by name, as export/unet_chunks.py cuts a slotted UNet) and run on the GPU delegate (lavapipe): the
mechanics, not the SD-size figures (scripts/gpu/lora_bundle.sh)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from script_module import load_script  # tests/script_module.py

MODULES = ("mid_block.attentions.0.transformer_blocks.0.attn1.to_q", "mid_block.attentions.0.transformer_blocks.0.attn2.to_k")
WIDTH, TOKENS, RANK = 32, 64, 4


class _Toy(torch.nn.Module):
    """proj_i(x) per module (plain), + (x @ down_i) @ up_i with the factors as inputs (slotted), on [1, TOKENS, WIDTH]."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.projs = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in MODULES)
        for p in self.projs:
            torch.nn.init.normal_(p.weight, std=WIDTH ** -0.5, generator=g)

    def forward(self, sample, **factors):
        x = sample.reshape(-1, WIDTH)
        for m, proj in zip(MODULES, self.projs):
            y = proj(x)
            if factors:
                from pocketdiff.lora_keys import slot_input_names

                down, up = (factors[n] for n in slot_input_names(m))
                y = y + (x @ down) @ up
            x = torch.tanh(y)
        return x.reshape(sample.shape)


def _layout(root: Path, name: str, slotted: bool) -> Path:
    """A bundle-like folder: the graph and the manifest fields the measurement reads (unet's path and declared inputs,
    lora_slots), as `pocketdiff export components=[unet]` writes them."""
    import litert_torch

    from pocketdiff.lora_keys import slot_input_names
    from pocketdiff.runtime.manifest_check import tflite_io

    folder = root / name
    folder.mkdir(parents=True)
    kwargs = {"sample": torch.randn(1, TOKENS, WIDTH)}
    if slotted:
        for m in MODULES:
            d, u = slot_input_names(m)
            kwargs[d], kwargs[u] = torch.zeros(WIDTH, RANK), torch.zeros(RANK, WIDTH)
    edge = litert_torch.convert(_Toy().eval(), (), sample_kwargs=kwargs)
    edge.export(str(folder / "unet.tflite"))
    man = {"image": {"height": 16}, "components": {"unet": {"path": "unet.tflite", "weights": "fp32",
                                                             "inputs": tflite_io(folder / "unet.tflite")["inputs"]}}}
    if slotted:
        man["lora_slots"] = {"rank": RANK, "targets": list(MODULES), "inputs": {m: list(slot_input_names(m)) for m in MODULES}}
    (folder / "manifest.json").write_text(json.dumps(man))
    return folder


class _Chunk(torch.nn.Module):
    """Module k of the toy alone: tanh(proj_k(x) [+ (x @ down_k) @ up_k]) on its input (`sample`, then `hidden`)."""

    def __init__(self, toy: _Toy, k: int):
        super().__init__()
        self.proj, self.module = toy.projs[k], MODULES[k]

    def forward(self, **inputs):  # keyword inputs: the graph's input names (sample or hidden, the factors)
        x = inputs["sample"] if "sample" in inputs else inputs["hidden"]
        y = self.proj(x)
        if len(inputs) > 1:
            from pocketdiff.lora_keys import slot_input_names

            down, up = (inputs[n] for n in slot_input_names(self.module))
            y = y + (x @ down) @ up
        return torch.tanh(y)


def _chunked_layout(root: Path, name: str, slotted: bool) -> Path:
    """A two-chunk bundle-like folder: unet.0 (sample -> hidden, the first module's slots), unet.1 (hidden -> out, the
    second's), the manifest's unet_chunks block (the whole UNet's inputs, the factors among them; unet.0's output
    aliased `hidden`), as export writes a chunked slotted UNet."""
    import litert_torch

    from pocketdiff.lora_keys import slot_input_names
    from pocketdiff.runtime.manifest_check import tflite_io

    folder = root / name
    folder.mkdir(parents=True)
    torch.manual_seed(0)  # the biases too (Linear's own init): plain and slotted share every weight
    toy = _Toy().eval()
    comps, aliases = {}, []
    for k, first in enumerate(("sample", "hidden")):
        kwargs = {first: torch.randn(TOKENS, WIDTH)}
        if slotted:
            d, u = slot_input_names(MODULES[k])
            kwargs[d], kwargs[u] = torch.zeros(WIDTH, RANK), torch.zeros(RANK, WIDTH)
        edge = litert_torch.convert(_Chunk(toy, k).eval(), (), sample_kwargs=kwargs)
        edge.export(str(folder / f"unet.{k}.tflite"))
        io = tflite_io(folder / f"unet.{k}.tflite")
        comps[f"unet.{k}"] = {"path": f"unet.{k}.tflite", "weights": "fp32", "inputs": io["inputs"], "outputs": io["outputs"]}
        aliases.append({"hidden": io["outputs"][0]["name"]} if k == 0 else {})
    whole_in = [i for c in comps.values() for i in c["inputs"] if i["name"] != "hidden"]
    man = {"schema_version": 2, "image": {"height": 16}, "components": comps,
           "unet_chunks": {"components": list(comps), "inputs": whole_in, "aliases": aliases}}
    if slotted:
        man["lora_slots"] = {"rank": RANK, "targets": list(MODULES), "inputs": {m: list(slot_input_names(m)) for m in MODULES}}
    (folder / "manifest.json").write_text(json.dumps(man))
    return folder


def _measure_layouts(root, make_layout, steps: int) -> dict:
    """A slotted (r4) and a plain layout written by `make_layout(root, name, slotted)`, measured by the benchmark."""
    with torch.no_grad():
        make_layout(root, "r4", True)
        make_layout(root, "plain", False)
    return load_script("benchmarks/lora_bundle.py", "lora_bundle_bench").measure(root, root / "out.json", steps=steps, timeout=120)


@pytest.fixture(scope="module")
def measured(gpu_delegate, tmp_path_factory) -> dict:
    return _measure_layouts(tmp_path_factory.mktemp("lora_bundles"), _layout, steps=3)


def test_each_layout_is_measured_in_its_own_process_plain_first(measured):
    rows = measured["rows"]
    assert [r["layout"] for r in rows] == ["plain", "r4"], rows  # by rank, whatever the folder names sort as
    plain, slots = rows
    assert plain["rank"] == 0 and plain["factor_inputs"] == 0 and plain["swaps"] == []
    assert slots["rank"] == RANK and slots["slot_modules"] == 2 and slots["factor_inputs"] == 4
    assert slots["factor_input_bytes"] == 2 * 2 * WIDTH * RANK * 4
    for r in rows:
        assert r["fully_accelerated"] is True and r["finite"] is True and r["step_ms"] > 0
        assert [p["phase"] for p in r["phases"]][:5] == ["start", "environment", "opened", "compiled", "first_run"]
        assert r["phases"][-1]["phase"] == "released" and r["host_peak_mb"] > 0  # the ledger's figures, measured
    assert slots["step_ms_over_plain"] == round(slots["step_ms"] / plain["step_ms"], 4)
    assert "host_rss_mb_compiled_over_plain" in slots


def test_a_swap_feeds_the_loras_factors_and_none_gives_the_plain_output_back(measured):
    swaps = {s["to"]: s for s in measured["rows"][1]["swaps"]}
    assert list(swaps) == ["lora_a", "lora_b", "none"]
    assert swaps["lora_a"]["max_abs_change_vs_no_lora"] > 1e-3 and swaps["lora_b"]["max_abs_change_vs_no_lora"] > 1e-3
    assert swaps["none"]["max_abs_change_vs_no_lora"] == 0.0  # zero factors again: the no-LoRA output exactly
    assert all(s["finite"] and s["load_ms"] >= 0 and s["first_step_ms"] > 0 for s in swaps.values())
    assert swaps["lora_a"]["file_bytes"] > 0 and swaps["none"]["file_bytes"] is None


def test_the_written_lora_reads_back_through_the_runtime(tmp_path):
    lb = load_script("benchmarks/lora_bundle.py", "lora_bundle_bench")
    from pocketdiff.runtime.lora_slots import read_safetensors

    path = lb.lora_for_slots(tmp_path / "l.safetensors", {MODULES[0]: (WIDTH, 48)}, rank=3, seed=1)
    tensors, meta = read_safetensors(path, "--lora")
    assert meta == {} and tensors[f"unet.{MODULES[0]}.lora_A.weight"].shape == (3, WIDTH)
    assert tensors[f"unet.{MODULES[0]}.lora_B.weight"].shape == (48, 3)
    assert np.isfinite(tensors[f"unet.{MODULES[0]}.lora_B.weight"]).all()


def test_measure_refuses_a_folder_without_bundles(tmp_path, capsys):
    lb = load_script("benchmarks/lora_bundle.py", "lora_bundle_bench")
    assert lb.main(["measure", str(tmp_path), "--out", str(tmp_path / "o.json")]) == 2
    assert "holds no bundle folder" in capsys.readouterr().err


@pytest.fixture(scope="module")
def measured_chunks(gpu_delegate, tmp_path_factory) -> dict:
    return _measure_layouts(tmp_path_factory.mktemp("lora_chunked"), _chunked_layout, steps=2)


def test_a_chunked_unet_runs_its_chunks_per_step_with_the_factors_fed_by_name(measured_chunks, measured):
    rows = measured_chunks["rows"]
    assert [r["layout"] for r in rows] == ["plain", "r4"] and measured_chunks["bundle"]["unet_chunks"] == 2
    assert all(r["unet_chunks"] == 2 and r["fully_accelerated"] and r["finite"] for r in rows), rows
    assert all(r["unet_chunks"] == 1 for r in measured["rows"])  # the whole graph: one part
    plain, slots = rows
    assert slots["factor_inputs"] == 4 and slots["slot_modules"] == 2
    # zero factors: the plain chunked bundle's step (same weights, same inputs), within float noise of the delegate
    assert "no_lora_max_abs_vs_plain" not in plain and slots["plain_max_abs"] > 0.1
    assert slots["no_lora_max_abs_vs_plain"] < 1e-4, slots["no_lora_max_abs_vs_plain"]
    swaps = {s["to"]: s for s in slots["swaps"]}
    assert swaps["lora_a"]["max_abs_change_vs_no_lora"] > 1e-3 and swaps["lora_b"]["max_abs_change_vs_no_lora"] > 1e-3
    assert swaps["none"]["max_abs_change_vs_no_lora"] == 0.0
