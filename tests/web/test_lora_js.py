"""web/static/lora.js, the page's and Node runner's twin of runtime/lora_slots.py, under node: the factors it feeds a
slotted bundle's UNet from a LoRA file (diffusers / PEFT with its metadata alpha, kohya with alpha keys, F16 and BF16
tensors, a smaller rank zero-padded) against numpy's, and the same files refused (the first key at fault named).
A synthetic manifest (two slotted projections) stands for a bundle: no model runs."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pocketdiff.errors import PocketdiffError
from pocketdiff.lora_keys import slot_input_names
from pocketdiff.runtime.lora_slots import LoraFeeds

HARNESS = Path(__file__).resolve().parent / "lora_harness.mjs"
MODULES = {"down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q": (32, 32),
           "up_blocks.1.attentions.0.transformer_blocks.0.attn2.to_out.0": (32, 48)}
RANK = 4


def _manifest() -> dict:
    inputs = [{"name": "sample", "shape": [2, 4, 8, 8], "dtype": "float32"}]
    for m, (n_in, n_out) in MODULES.items():
        d, u = slot_input_names(m)
        inputs += [{"name": d, "shape": [n_in, RANK], "dtype": "float32"}, {"name": u, "shape": [RANK, n_out], "dtype": "float32"}]
    return {"components": {"unet": {"inputs": inputs}},
            "lora_slots": {"rank": RANK, "targets": list(MODULES), "inputs": {m: list(slot_input_names(m)) for m in MODULES}}}


def _files(tmp_path: Path) -> dict[str, Path]:
    g = torch.Generator().manual_seed(0)
    peft, kohya = {}, {}
    for m, (n_in, n_out) in MODULES.items():
        down, up = torch.randn(2, n_in, generator=g), torch.randn(n_out, 2, generator=g)
        peft[f"unet.{m}.lora_A.weight"], peft[f"unet.{m}.lora_B.weight"] = down, up
        k = "lora_unet_" + m.replace(".", "_")
        kohya[f"{k}.lora_down.weight"], kohya[f"{k}.lora_up.weight"] = down.half(), up.to(torch.bfloat16)
        kohya[f"{k}.alpha"] = torch.tensor(3.0)
    files = {"peft": tmp_path / "peft.safetensors", "kohya": tmp_path / "kohya.safetensors"}
    save_file(peft, str(files["peft"]), metadata={"lora_adapter_metadata": json.dumps({"unet.lora_alpha": 8, "unet.r": 2})})
    save_file(kohya, str(files["kohya"]))
    m = next(iter(MODULES))
    save_file({f"unet.{m}.lora_A.weight": torch.ones(8, 32), f"unet.{m}.lora_B.weight": torch.ones(32, 8)}, str(tmp_path / "r8.safetensors"))
    save_file({f"unet.{m}.lora_A.weight": torch.ones(4, 320), f"unet.{m}.lora_B.weight": torch.ones(320, 4)}, str(tmp_path / "sd.safetensors"))
    other = "unet.mid_block.attentions.0.transformer_blocks.0.attn1.to_q"
    save_file({f"{other}.lora_A.weight": torch.ones(4, 32), f"{other}.lora_B.weight": torch.ones(32, 4)}, str(tmp_path / "other.safetensors"))
    files.update(r8=tmp_path / "r8.safetensors", sd=tmp_path / "sd.safetensors", other=tmp_path / "other.safetensors")
    return files


def test_lora_js_feeds_what_numpy_feeds_and_refuses_the_same_files(node, tmp_path):
    man, files = _manifest(), _files(tmp_path)
    order = ["peft", "kohya", "r8", "sd", "other"]
    req = tmp_path / "request.json"
    req.write_text(json.dumps({"manifest": man, "cases": [{"file": None, "scale": 1.0}] + [{"file": str(files[k]), "scale": 0.6} for k in order]}))
    res = subprocess.run([node, str(HARNESS), str(req)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    zeros, *got = json.loads(res.stdout)
    assert all(not any(v["data"]) for v in zeros["feeds"].values()) and len(zeros["feeds"]) == 2 * len(MODULES)
    for name, out in zip(order, got):
        feeds = LoraFeeds(man, "b")
        try:
            feeds.load(files[name], 0.6)
        except PocketdiffError as e:
            assert "error" in out, (name, out)
            key = str(e).split("key ")[1].split(" ")[0].strip("'\":")  # the first key at fault, as both name it
            assert key in out["error"], (name, str(e), out["error"])
            continue
        assert "feeds" in out, (name, out)
        for k, v in feeds.feeds.items():
            js = np.asarray(out["feeds"][k]["data"], np.float32).reshape(out["feeds"][k]["shape"])
            # float32 factors times one scale: the same products, up to the last bit of the scale's rounding
            np.testing.assert_allclose(js, v, rtol=1e-6, atol=1e-7)
        assert not feeds.feeds[slot_input_names(next(iter(MODULES)))[0]][:, 2:].any()  # rank 2 padded to 4


@pytest.mark.parametrize("blob", [b"\x80\x04\x95" + bytes(40), b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": 1", b""])
def test_lora_js_refuses_pickles_and_corrupt_files_in_one_line(node, tmp_path, blob):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(blob)
    req = tmp_path / "request.json"
    req.write_text(json.dumps({"manifest": _manifest(), "cases": [{"file": str(bad), "scale": 1.0}]}))
    res = subprocess.run([node, str(HARNESS), str(req)], capture_output=True, text=True, timeout=120)
    [out] = json.loads(res.stdout)
    assert "error" in out and "\n" not in out["error"]
    assert ("a pickle" in out["error"]) == blob.startswith(b"\x80")


def _chunked(man: dict) -> dict:
    """`man` as a chunked UNet's: each slot's inputs declared by the chunk holding it (unet.0, unet.1)."""
    ins = man["components"]["unet"]["inputs"]
    return {**man, "components": {"unet.0": {"inputs": ins[:3]}, "unet.1": {"inputs": [ins[0], *ins[3:]]}}}


def test_lora_js_feeds_a_chunked_unet_as_numpy_and_refuses_a_slot_no_chunk_declares(node, tmp_path):
    """The slots found by the chunks' declared inputs (runtime/BUNDLE.md): the same feeds as the whole UNet's, in both
    readers; a slot whose inputs no chunk declares is one line in both."""
    man, files = _chunked(_manifest()), _files(tmp_path)
    ghost = "mid_block.attentions.0.transformer_blocks.0.attn1.to_q"
    lost = {**man, "lora_slots": {**man["lora_slots"], "targets": [*man["lora_slots"]["targets"], ghost]}}
    req = tmp_path / "request.json"
    results = []
    for m in (man, lost):
        req.write_text(json.dumps({"manifest": m, "cases": [{"file": str(files["peft"]), "scale": 0.6}]}))
        res = subprocess.run([node, str(HARNESS), str(req)], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        results += json.loads(res.stdout)
    fed, refused = results
    feeds = LoraFeeds(man, "b")
    feeds.load(files["peft"], 0.6)
    assert set(fed["feeds"]) == set(feeds.feeds)
    for k, v in feeds.feeds.items():
        np.testing.assert_allclose(np.asarray(fed["feeds"][k]["data"], np.float32).reshape(v.shape), v, rtol=1e-6, atol=1e-7)
    with pytest.raises(PocketdiffError, match="no component declares") as e:
        LoraFeeds(lost, "b")
    assert "\n" not in str(e.value) and ghost in str(e.value)
    assert "error" in refused and "no component declares" in refused["error"] and ghost in refused["error"], refused
