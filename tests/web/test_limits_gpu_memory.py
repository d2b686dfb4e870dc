"""Issue 50: the page's limits check (web/static/tflite.js, limits.js) against Python's TFLite flatbuffer reader and
on artificially low limits; the WebGPU ledger (gpu_device.js); the Node runner on Dawn (lavapipe here): a bundle over
a limit is refused before anything compiles with one line naming the component and the limit, and with a device per
model a streamed UNet gives its chunks' GPU memory back (the ledger's peak below resident's, nothing alive at the end,
where LiteRT.js's one shared device keeps released models' buffers)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from node_runner_cli import dawn_or_skip, run_node_runner  # tests/node_runner_cli.py

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "limits_harness.mjs"
RUNNER = HERE.parents[1] / "web" / "node_runner.mjs"
SMOKE = HERE / "smoke_bundle"


def _harness(node: str, tmp_path: Path, **req) -> dict:
    base = {"files": [], "problems": [], "bad_overrides": [], "preflights": [], "bundle": str(SMOKE)}
    path = tmp_path / "req.json"
    path.write_text(json.dumps({**base, **req}))
    p = subprocess.run([node, str(HARNESS), str(path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


def _python_sizes(path: Path) -> dict:
    from ai_edge_litert import schema_py_generated as fb

    model = fb.Model.GetRootAsModel(path.read_bytes(), 0)
    buffers = [model.Buffers(i).DataLength() for i in range(model.BuffersLength())]
    tensors, weights, largest = 0, 0, (0, "")
    for s in range(model.SubgraphsLength()):
        sg = model.Subgraphs(s)
        for i in range(sg.TensorsLength()):
            t = sg.Tensors(i)
            n = int(np.prod([max(int(d), 1) for d in t.ShapeAsNumpy()])) if t.ShapeLength() else 1
            tensors += 1
            if buffers[t.Buffer()] > 0:
                weights += n
            largest = max(largest, (n, t.Name().decode()))
    return {"tensors": tensors, "weights": weights, "largest_elements": largest[0]}


@pytest.mark.parametrize("name", ["unet.tflite", "text_encoder.tflite", "vae_decoder.tflite"])
def test_tflite_sizes_match_pythons_flatbuffer_reader(node, tmp_path, name):
    f = SMOKE / name
    got = _harness(node, tmp_path, files=[str(f)])["sizes"][str(f)]
    want = _python_sizes(f)
    assert got["tensors"] == want["tensors"] and got["tensors"] > 100
    assert got["weightElements"] == want["weights"] > 0
    assert got["largest"]["elements"] == want["largest_elements"]
    assert got["external"] == 0  # the exporter writes no external buffers (loadModelAndWeights would need them)


def test_one_line_problems_name_the_component_and_the_limit(node, tmp_path):
    unet = str(SMOKE / "unet.tflite")
    cases = [
        {"name": "unet", "file": unet, "adapter": {"maxStorageBufferBindingSize": 150000, "maxBufferSize": 1 << 30}, "overrides": {}, "opts": {}},
        {"name": "unet", "file": unet, "adapter": {"maxStorageBufferBindingSize": 1 << 30, "maxBufferSize": 150000}, "overrides": {}, "opts": {}},
        {"name": "unet", "file": unet, "adapter": {}, "overrides": {"wasmHeap": 5_000_000}, "opts": {}},
        {"name": "unet", "file": unet, "adapter": {}, "overrides": {"wasmHeap": 8_000_000}, "opts": {}},  # fits alone
        {"name": "unet", "file": unet, "adapter": {}, "overrides": {"wasmHeap": 8_000_000},
         "opts": {"heldBytes": 2_000_000, "heldWhat": "the other resident UNet chunks"}},
        {"name": "unet", "file": unet, "adapter": {"maxStorageBufferBindingSize": 150000}, "overrides": {}, "opts": {"accelerator": "wasm"}},
    ]
    p = _harness(node, tmp_path, problems=cases)["problems"]
    assert p[0].startswith("unet: ") and "maxStorageBufferBindingSize 0.1 MiB" in p[0] and "[2, 8, 64, 77]" in p[0]
    assert "maxBufferSize" in p[1] and "\n" not in p[1]
    assert "wasm heap" in p[2] and "wasmHeap 4.8 MiB" in p[2] and "unet=streamed" not in p[2]
    assert p[3] is None
    assert "the other resident UNet chunks holding 1.9 MiB" in p[4] and "unet=streamed holds one UNet chunk" in p[4]
    assert p[5] is None  # the wasm CPU path binds no GPU buffers


def _externalize(src: Path, dst: Path, min_bytes: int = 1024) -> int:
    """`src` written to `dst` with its constant buffers of >= min_bytes moved to dst.weights (TFLite schema: Tensor
    .external_buffer naming a Model.external_buffers entry of one group): the layout LiteRT.js's loadModelAndWeights
    streams from. Returns how many tensors went external."""
    import flatbuffers
    from ai_edge_litert import schema_py_generated as fb

    model = fb.ModelT.InitFromPackedBuf(bytearray(src.read_bytes()), 0)
    weights, ext, moved = bytearray(), [], {}
    for sg in model.subgraphs:
        for t in sg.tensors:
            data = model.buffers[t.buffer].data
            if data is None or len(data) < min_bytes:
                continue
            if t.buffer not in moved:
                weights += bytes(-len(weights) % 64)
                e = fb.ExternalBufferT()
                e.id, e.group, e.offset, e.length = len(ext) + 1, 0, len(weights), len(data)
                weights += bytes(np.asarray(data, dtype=np.uint8))
                ext.append(e)
                moved[t.buffer] = e.id
            t.externalBuffer, t.buffer = moved[t.buffer], 0
    for i in moved:
        model.buffers[i].data = None
    group = fb.ExternalBufferGroupT()
    group.name = dst.name + ".weights"
    model.externalBufferGroups, model.externalBuffers = [group], ext
    b = flatbuffers.Builder(1024)
    b.Finish(model.Pack(b), file_identifier=b"TFL3")
    dst.write_bytes(b.Output())
    dst.with_name(group.name).write_bytes(weights)
    return sum(t.externalBuffer > 0 for sg in model.subgraphs for t in sg.tensors)


def test_a_component_with_external_weights_is_refused_before_loading(node, tmp_path):
    """LiteRT.js 2.5.3 compiles no model with external buffers (loadAndCompile and loadModelAndWeights alike:
    docs/MEASUREMENTS.md, web section): such a component is refused in one line, not left to fail in the wasm."""
    ext = tmp_path / "unet_ext.tflite"
    n = _externalize(SMOKE / "unet.tflite", ext)
    out = _harness(node, tmp_path, files=[str(ext)], problems=[
        {"name": "unet", "file": str(ext), "adapter": {}, "overrides": {}, "opts": {}},
        {"name": "unet", "file": str(ext), "adapter": {}, "overrides": {}, "opts": {"accelerator": "wasm"}}])
    assert out["sizes"][str(ext)]["external"] == n > 10
    assert out["sizes"][str(ext)]["weightElements"] == _python_sizes(SMOKE / "unet.tflite")["weights"]  # still counted
    for p in out["problems"]:
        assert p.startswith(f"unet: {n} of its tensors keep their weights in external buffers") and "LiteRT.js 2.5.3" in p
        assert "refused before loading" in p and "\n" not in p


def test_bad_limit_overrides_are_refused(node, tmp_path):
    errs = _harness(node, tmp_path, bad_overrides=[["maxStorageBufferBindingSize=1000"], ["foo=3"], ["wasmHeap=lots"]])["errors"]
    assert errs[0] is None
    assert "limit foo: unknown" in errs[1] and "wasmHeap" in errs[1]
    assert "expected NAME=BYTES" in errs[2]


def test_preflight_refuses_before_loading_and_counts_resident_chunks(node, tmp_path, assemble_chunked):
    bundle = assemble_chunked(tmp_path / "chunked")
    dec = bundle / "vae_decoder.tflite"
    dec_need = dec.stat().st_size + 8 * _python_sizes(dec)["weights"]  # limits.js's estimate for WebGPU
    heap = dec_need + 500_000  # the decoder fits alone, not beside the resident UNet chunks' files (1.3 MB)
    out = _harness(node, tmp_path, bundle=str(bundle), preflights=[
        {"adapter": {}, "overrides": {"wasmHeap": heap}, "opts": {"streamed": True}},
        {"adapter": {}, "overrides": {"wasmHeap": heap}, "opts": {"streamed": False}},
        {"adapter": {"maxStorageBufferBindingSize": 100000}, "overrides": {}, "opts": {}},
    ])["preflight"]
    assert set(out[0]["ok"]) == {"text_encoder.0", "text_encoder.1", "unet.0", "unet.1", "vae_decoder"}, out[0]
    assert out[1]["name"] == "BundleError" and out[1]["error"].startswith("vae_decoder: "), out[1]
    assert "with the resident UNet chunks holding" in out[1]["error"] and "unet=streamed" in out[1]["error"]
    assert out[2]["error"].startswith("text_encoder.0: ") and "maxStorageBufferBindingSize" in out[2]["error"]


def test_ledger_counts_until_destroyed_and_the_rest_with_the_device(node, tmp_path):
    steps = _harness(node, tmp_path)["ledger"]
    mb = 1024 * 1024
    tex = 256 * 256 * 8 / mb
    assert steps[0]["live_mb"] == pytest.approx(4 + tex, abs=0.01) and steps[0]["peak_mb"] == steps[0]["live_mb"]
    assert steps[1]["live_mb"] == pytest.approx(3 + tex, abs=0.01) and steps[1]["peak_mb"] == steps[0]["peak_mb"]
    assert steps[2]["live_mb"] == 0 and steps[2]["per_device"][0]["models"] == ["unet.0"]
    # what a 64 KiB-granular power-of-two sub-allocator would take: 1 MB, 3 -> 4 MB, the texture's 0.5 MB, 512 B -> 64 KiB
    assert [s["live_count"] for s in steps] == [4, 3, 0]
    assert [s["live_rounded_mb"] for s in steps] == [pytest.approx(5.5625, abs=0.01), pytest.approx(4.5625, abs=0.01), 0]


# --- the Node runner on Dawn (lavapipe here, the real GPU elsewhere) ---

@pytest.fixture(scope="module")
def dawn(node) -> str:
    return dawn_or_skip(node)


def _run(node: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return run_node_runner(node, *args, timeout=timeout, skip_without_adapter=True)


def test_node_runner_stops_before_loading_naming_the_component_and_the_limit(dawn, smoke_bundle):
    p = _run(dawn, str(smoke_bundle), "--limit", "maxStorageBufferBindingSize=150000", timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    line = [l for l in p.stderr.splitlines() if l.startswith("node_runner: ")]
    assert len(line) == 1 and "maxStorageBufferBindingSize 0.1 MiB" in line[0] and "refused before loading" in line[0]
    assert line[0].split(": ")[1] in {"text_encoder", "unet", "vae_decoder"}
    assert "compiled in" not in p.stderr  # nothing was loaded


@pytest.fixture(scope="module")
def chunked_runs(dawn, tmp_path_factory, assemble_chunked):
    root = tmp_path_factory.mktemp("gpu_memory")
    bundle = assemble_chunked(root / "bundle")
    runs = {"heap": _heap_for_streamed_only(bundle)}
    for unet, device in (("resident", "per-model"), ("streamed", "per-model"), ("streamed", "shared")):
        out = root / f"{unet}_{device}.json"
        heap = ["--limit", f"wasmHeap={runs['heap']}"] if device == "per-model" and unet == "streamed" else []
        p = _run(dawn, str(bundle), "--unet", unet, "--gpu-device", device, "--no-goldens", "--out", str(out), *heap)
        assert p.returncode == 0, p.stderr[-3000:]
        runs[(unet, device)] = json.loads(out.read_text())
    runs["bundle"] = bundle
    return runs


def _heap_for_streamed_only(bundle: Path) -> int:
    """A wasm heap (bytes) that every component of the chunked bundle fits alone (limits.js's estimate), the decoder
    not beside the resident UNet chunks' files (1.3 MB)."""
    dec = bundle / "vae_decoder.tflite"
    return dec.stat().st_size + 8 * _python_sizes(dec)["weights"] + 500_000


def test_node_runner_refuses_a_resident_unet_over_the_wasm_heap_and_runs_it_streamed(chunked_runs, dawn):
    """The heap limit through the runner: resident, the decoder would compile beside the UNet's chunks' files and is
    refused before anything loads, naming the way out; streamed (one chunk at a time) the same limit passes."""
    heap = chunked_runs["heap"]
    p = _run(dawn, str(chunked_runs["bundle"]), "--unet", "resident", "--limit", f"wasmHeap={heap}", "--no-goldens", timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    line = [l for l in p.stderr.splitlines() if l.startswith("node_runner: ")]
    assert len(line) == 1 and line[0].startswith("node_runner: vae_decoder: compiling it needs ~"), line
    assert f"wasmHeap {heap / 2**20:.1f} MiB" in line[0] and "unet=streamed holds one UNet chunk" in line[0]
    assert "compiled in" not in p.stderr
    st = chunked_runs[("streamed", "per-model")]
    assert st["ok"] and st["limits"]["wasmHeap"] == heap and st["unet"] == "streamed"


def test_streamed_unet_gives_its_chunks_gpu_memory_back(chunked_runs):
    res, st, shared = chunked_runs[("resident", "per-model")], chunked_runs[("streamed", "per-model")], chunked_runs[("streamed", "shared")]
    for r in (res, st, shared):
        assert r["ok"], r["failures"]
        assert r["limits"]["maxStorageBufferBindingSize"] > 0  # the adapter's own
    assert res["limits"]["wasmHeap"] == shared["limits"]["wasmHeap"] == 2 ** 31  # LiteRT.js's (st runs under a lower one)
    assert st["gpu_memory"]["live_mb"] == 0  # every device destroyed
    assert shared["gpu_memory"]["live_mb"] > 0  # one shared device keeps what released models held
    assert st["gpu_memory"]["peak_mb"] < res["gpu_memory"]["peak_mb"]
    streamed_devices = [d["models"] for d in st["gpu_memory"]["per_device"]]
    assert all(len(m) == 1 for m in streamed_devices) and streamed_devices.count(["unet.0"]) == st["steps"] + 1  # its first compile, then one per step
    resident_unet = [d for d in res["gpu_memory"]["per_device"] if "unet.0" in d["models"]]
    assert len(resident_unet) == 1 and {"unet.0", "unet.1"} <= set(resident_unet[0]["models"])  # alive together: one device
    assert set(st["host_per_model_peak_mb"]) == {"text_encoder.0", "text_encoder.1", "unet.0", "unet.1", "vae_decoder"}
    assert all(v > 0 for v in st["host_per_model_peak_mb"].values()) and st["host_peak_mb"] >= max(st["host_per_model_peak_mb"].values())


# --- the page in headless Chromium (SwiftShader here) ---

@pytest.mark.parametrize("limit, names, says", [
    ("maxStorageBufferBindingSize:150000", {"text_encoder", "unet", "vae_decoder"}, "maxStorageBufferBindingSize 0.1 MiB"),
    ("wasmHeap:5000000", {"unet"}, "of LiteRT.js's wasm heap"),  # the int8 UNet: 1.5 MB file + 8 bytes a weight
])
def test_page_refuses_a_bundle_over_a_limit_before_loading(chromium, smoke_bundle, limit, names, says):
    from pocketdiff.web.headless import check_page
    from pocketdiff.web.page import PageConfig, write_page

    write_page(PageConfig(bundle=str(smoke_bundle), reference=False))
    r = check_page(smoke_bundle, timeout_s=300, executable=chromium, limit=limit)
    assert r["ok"] is False and len(r["failures"]) == 1, r
    line = r["failures"][0]
    assert line.split(": ")[0] in names and says in line, line
    assert "refused before loading" in line and "\n" not in line
    assert "components" not in r  # nothing compiled, nothing ran
