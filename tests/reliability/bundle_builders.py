"""Builders of a synthetic bundle whose manifest passes every check of runtime/manifest_check.py.

Its .tflite files are real LiteRT flatbuffers with a signature (the names, shapes and dtypes
the runner feeds and reads) but no ops: the checks read signatures, nothing here runs them.
Built in milliseconds, so each case of a table can break one thing in a fresh copy. A module of
its own (not conftest): a test's `from conftest import` may find another folder's conftest.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

T, STEPS, L, WIDTH, TIME_WIDTH = 1000, 4, 8, 16, 16
IO = {  # component -> (inputs, outputs): name -> (shape, dtype)
    "text_encoder": ({"input_ids": ([1, L], "int32")}, {"output_0": ([1, L, WIDTH], "float32")}),
    "unet": ({"sample": ([2, 4, 8, 8], "float32"), "timestep": ([2, TIME_WIDTH], "float32"),
              "encoder_hidden_states": ([2, L, WIDTH], "float32")}, {"output_0": ([2, 4, 8, 8], "float32")}),
    "vae_decoder": ({"latents": ([1, 4, 8, 8], "float32")}, {"output_0": ([1, 3, 32, 32], "float32")}),
}


def signature_tflite(inputs: dict, outputs: dict) -> bytes:
    """A .tflite flatbuffer whose signature has these inputs and outputs (name -> (shape, dtype))."""
    import flatbuffers
    from ai_edge_litert import schema_py_generated as schema

    types = {"float32": schema.TensorType.FLOAT32, "int32": schema.TensorType.INT32}
    m = schema.ModelT()
    m.version = 3
    m.operatorCodes, m.buffers = [], [schema.BufferT()]
    g = schema.SubGraphT()
    g.tensors, g.operators = [], []
    sig = schema.SignatureDefT()
    sig.signatureKey, sig.subgraphIndex, sig.inputs, sig.outputs = "serving_default", 0, [], []
    for io, target in ((inputs, sig.inputs), (outputs, sig.outputs)):
        for name, (shape, dtype) in io.items():
            t = schema.TensorT()
            t.shape, t.type, t.buffer, t.name = list(shape), types[dtype], 0, f"serving_default_{name}:0"
            tm = schema.TensorMapT()
            tm.name, tm.tensorIndex = name, len(g.tensors)
            g.tensors.append(t)
            target.append(tm)
    g.inputs, g.outputs = [tm.tensorIndex for tm in sig.inputs], [tm.tensorIndex for tm in sig.outputs]
    m.subgraphs, m.signatureDefs = [g], [sig]
    b = flatbuffers.Builder(1024)
    b.Finish(m.Pack(b), file_identifier=b"TFL3")
    return bytes(b.Output())


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def entry(bundle: Path, rel: str) -> dict:
    p = bundle / rel
    return {"path": rel, "sha256": sha256(p), "bytes": p.stat().st_size}


def make_bundle(b: Path) -> Path:
    """Write the synthetic bundle into folder `b` (created)."""
    b.mkdir(parents=True)
    comps = {}
    for name, (ins, outs) in IO.items():
        (b / f"{name}.tflite").write_bytes(signature_tflite(ins, outs))
        comps[name] = {**entry(b, f"{name}.tflite"), "weights": "fp16",
                       "inputs": [{"name": k, "shape": s, "dtype": d} for k, (s, d) in ins.items()],
                       "outputs": [{"name": k, "shape": s, "dtype": d} for k, (s, d) in outs.items()]}
    (b / "tokenizer").mkdir()
    (b / "tokenizer" / "tokenizer.json").write_text("{}")
    np.save(b / "time_embedding.npy", np.zeros((T, TIME_WIDTH), np.float32))
    betas = np.linspace(0.00085 ** 0.5, 0.012 ** 0.5, T) ** 2
    alphas = np.cumprod(1.0 - betas)
    manifest = {
        "schema": "pocketdiff-bundle", "schema_version": 1, "created_by": "tests",
        "image": {"height": 32, "width": 32, "channels": 3},
        "latent": {"channels": 4, "height": 8, "width": 8, "vae_factor": 4},
        "guidance": {"mode": "cfg", "scale": 3.0, "unet_batch": 2},
        "scheduler": {"type": "ddim", "prediction_type": "epsilon", "num_train_timesteps": T, "steps": STEPS,
                      "timesteps": [751, 501, 251, 1], "alphas_cumprod": [float(a) for a in alphas],
                      "final_alpha_cumprod": float(alphas[0]), "timestep_spacing": "leading", "steps_offset": 1, "eta": 0.0},
        "tokenizer": {"files": {"tokenizer.json": entry(b, "tokenizer/tokenizer.json")}, "max_length": L, "pad_id": 0,
                      "bos_id": 1, "eos_id": 2},
        "time_embedding": {**entry(b, "time_embedding.npy"), "shape": [T, TIME_WIDTH], "dtype": "float32"},
        "components": comps,
    }
    (b / "manifest.json").write_text(json.dumps(manifest))
    return b
