"""Child process of `pocketdiff.runtime.delegate.run_on_delegate` (started with the Vulkan env).

Reads request.json, compiles the model per precision, runs the inputs, writes result.json and
out_<precision>.npz into the request's out_dir, with the measured memory after compiling and after
running (runtime/memory.py). Imports only numpy, ai_edge_litert and the runtime.
"""
from __future__ import annotations

import json
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np


_TEARDOWN_S = 90


def _np_dtype(name: str):
    return np.dtype({"float32": "float32", "float16": "float16", "int32": "int32", "int64": "int64", "int8": "int8", "uint8": "uint8", "bool": "bool"}.get(name, name))


def _run(model, sig, in_names, out_names, inputs, input_names_given, req) -> tuple[dict, list]:
    """Write the inputs (in the model's order), run warmup + repeats, read every output."""
    in_details = model.get_input_tensor_details(sig)
    out_details = model.get_output_tensor_details(sig)
    if input_names_given and set(input_names_given) == set(in_names):
        ordered = [inputs[input_names_given.index(n)] for n in in_names]
    else:
        ordered = inputs
    if len(ordered) != len(in_names):
        raise ValueError(f"model takes {len(in_names)} inputs {in_names}, got {len(ordered)}")
    in_bufs = model.create_input_buffers(0)
    out_bufs = model.create_output_buffers(0)
    for buf, name, arr in zip(in_bufs, in_names, ordered):
        det = in_details[name]
        want = list(det["shape"])
        arr = np.ascontiguousarray(np.asarray(arr).astype(_np_dtype(det["dtype"])))
        if list(arr.shape) != want:
            raise ValueError(f"input {name}: shape {list(arr.shape)} != model's {want}")
        buf.write(arr)
    def read_outputs() -> dict:
        outs = {}
        for i, (buf, name) in enumerate(zip(out_bufs, out_names)):
            det = out_details[name]
            shape = [int(s) for s in det["shape"]]
            n = int(np.prod(shape)) if shape else 1
            outs[f"out_{i}"] = np.asarray(buf.read(n, _np_dtype(det["dtype"]))).reshape(shape)
        return outs

    times = []
    for i in range(int(req.get("warmup", 0)) + max(1, int(req.get("repeats", 1)))):
        t0 = time.perf_counter()
        model.run_by_index(0, in_bufs, out_bufs)
        if req.get("timed_read"):  # a GPU run may return on submission: reading the outputs waits for the result
            read_outputs()
        if i >= int(req.get("warmup", 0)):
            times.append(time.perf_counter() - t0)
    outs = read_outputs()
    # release everything before the next precision: a second CompiledModel cannot
    # write its inputs while the first one's buffers are alive
    for buf in list(in_bufs) + list(out_bufs):
        buf.destroy()
    return outs, times


def main(request_path: str) -> int:
    req = json.loads(Path(request_path).read_text())
    out_dir = Path(req["out_dir"])
    result: dict = {"compiled": False, "fully_accelerated": False, "ran": [], "compile_s": {}, "latency_s": {}, "memory": {}}
    from pocketdiff.runtime.memory import PeakSampler

    sampler = PeakSampler()

    def flush() -> None:
        (out_dir / "result.json").write_text(json.dumps(result))

    try:
        from ai_edge_litert.compiled_model import CompiledModel, CpuOptions, GpuOptions, HardwareAccelerator, Options

        inputs = None
        input_names_given: list[str] = []
        if req.get("inputs"):
            data = np.load(req["inputs"])
            inputs = [data[f"in_{i}"] for i in range(len(data.files))]
            names_file = Path(req["inputs"]).parent / "input_names.json"
            if names_file.is_file():
                input_names_given = json.loads(names_file.read_text())
        for prec in req["precisions"]:
            if req["accelerator"] == "gpu":
                opts = Options(
                    hardware_accelerators=HardwareAccelerator.GPU,
                    gpu_options=GpuOptions(enforce_f32=(prec == "fp32")),
                )
            else:
                opts = Options(
                    hardware_accelerators=HardwareAccelerator.CPU,
                    cpu_options=CpuOptions(num_threads=int(req.get("num_threads") or 0) or None) if req.get("num_threads") else None,
                )
            t0 = time.perf_counter()
            model = CompiledModel.from_file(req["model"], options=opts)
            result["compile_s"][prec] = time.perf_counter() - t0
            result["compiled"] = True
            mem = result["memory"][prec] = {"compiled": sampler.mark()}
            result["fully_accelerated"] = bool(model.is_fully_accelerated())
            sig_list = model.get_signature_list()
            sig = next(iter(sig_list))
            in_names = list(sig_list[sig]["inputs"])
            out_names = list(sig_list[sig]["outputs"])
            result["input_names"], result["output_names"] = in_names, out_names
            flush()
            if inputs is None:
                continue
            outs, times = _run(model, sig, in_names, out_names, inputs, input_names_given, req)
            mem["ran"] = sampler.mark()
            np.savez(out_dir / f"out_{prec}.npz", **outs)
            result["latency_s"][prec] = statistics.median(times)
            result["ran"].append(prec)
            flush()
            model.close()
            del model
    except Exception as e:  # noqa: BLE001 - reported to the parent
        first = str(e).strip().splitlines()
        result["error"] = f"{type(e).__name__}: {first[0] if first else ''}"
        result["traceback"] = traceback.format_exc()
        flush()
        # Tearing down a GPU model after a failed run can hang (seen on lavapipe after a WebGPU
        # validation error), which would cost the caller its whole timeout; the teardown still
        # logs the delegate's own errors, so let it run, under a watchdog that ends the process.
        print(f"delegate worker: {result['error']} (exiting; teardown watchdog {_TEARDOWN_S} s)", file=sys.stderr, flush=True)
        if hasattr(signal, "alarm"):
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(_TEARDOWN_S)
        return 3
    result["memory_totals"] = sampler.totals()
    sampler.close()
    flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
