#!/usr/bin/env python
"""Issue 50, deliverable 2: can LiteRT.js 2.5.3 load weights outside its 2 GB wasm heap for us? Its ESM build exports
`loadModelAndWeights(modelData, weightsStream, options)`: the flatbuffer goes into the heap, and each weight the
WebGPU delegate asks for is written from the stream straight into its GPU buffer (`queue.writeBuffer(buffer, 0,
bytes)`, no conversion), for a .tflite whose constant tensors point into external buffers (TFLite schema fields
Model.external_buffer_groups / external_buffers {id, group, offset, length, packing}, Tensor.external_buffer).
Our exporter writes none. This probe builds a two-conv fp32 model in TensorFlow, externalizes its constants
(packing: none, the file's bytes as they are) and runs both forms on WebGPU through Dawn's Node bindings.

  python benchmarks/web_external_weights_probe.py --out benchmarks/results/web_external_weights_probe_cpu.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def build(folder: Path) -> dict:
    import tensorflow as tf

    inp = tf.keras.Input((16, 16, 8), batch_size=1)
    init = tf.keras.initializers.RandomNormal(stddev=0.2, seed=0)
    x = tf.keras.layers.Conv2D(32, 3, padding="same", kernel_initializer=init, bias_initializer="ones")(inp)
    model = tf.keras.Model(inp, tf.keras.layers.Conv2D(16, 1, kernel_initializer=init)(x))
    data = tf.lite.TFLiteConverter.from_keras_model(model).convert()
    (folder / "plain.tflite").write_bytes(data)
    x = np.random.default_rng(0).standard_normal((1, 16, 16, 8)).astype(np.float32)
    x.tofile(folder / "x.bin")
    model(x).numpy().astype(np.float32).tofile(folder / "y.bin")
    (folder / "shape.json").write_text(json.dumps(list(x.shape)))
    return externalize(data, folder)


def externalize(data: bytes, folder: Path) -> dict:
    """Every constant tensor's bytes moved into weights.bin (64-byte aligned), named by an external buffer."""
    import flatbuffers
    from ai_edge_litert import schema_py_generated as fb

    model = fb.ModelT.InitFromPackedBuf(bytearray(data), 0)
    group = fb.ExternalBufferGroupT()
    group.name = "weights.bin"
    blob, externals = bytearray(), []
    for t in model.subgraphs[0].tensors:
        buf = model.buffers[t.buffer]
        if buf.data is None or len(buf.data) == 0:
            continue
        blob += b"\0" * (-len(blob) % 64)
        e = fb.ExternalBufferT()
        e.id, e.group, e.offset, e.length, e.packing = len(externals) + 1, 0, len(blob), len(buf.data), None
        blob += bytes(bytearray(buf.data))
        externals.append(e)
        t.externalBuffer, t.buffer = e.id, 0
    model.externalBufferGroups, model.externalBuffers = [group], externals
    b = flatbuffers.Builder(1024)
    b.Finish(model.Pack(b), file_identifier=b"TFL3")
    (folder / "ext.tflite").write_bytes(b.Output())
    (folder / "weights.bin").write_bytes(blob)
    return {"constants_externalized": len(externals), "weights_bytes": len(blob), "plain_bytes": len(data), "ext_bytes": len(b.Output())}


def main() -> int:
    from pocketdiff.runtime.delegate import delegate_env

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="pocketdiff-extw-") as tmp:
        info = build(Path(tmp))
        env, driver = delegate_env()
        p = subprocess.run(["node", str(HERE / "web_external_weights_probe.mjs"), tmp], capture_output=True, text=True, env=env, timeout=600)
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"error": p.stderr[-2000:]}
    out = {"what": __doc__.split("\n\n")[0], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "driver": driver,
           "litertjs": json.loads((HERE.parent / "web/node_modules/@litertjs/core/package.json").read_text())["version"],
           "model": info, **result}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
