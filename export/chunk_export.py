"""Step 4 of the export for `unet_chunks: K > 1` or `text_encoder_chunks: K > 1`: the model as K .tflite
files (export/unet_chunks.py, export/text_encoder_chunks.py).

The whole model is prepared once as for one file (its reference, the rewrites, their parity), then cut at
block (or layer) boundaries into K graphs that share its rewritten modules. Checked: the original model's
chunks in sequence equal the whole model in torch; each chunk on the GPU delegate against its torch chunk on
the same inputs (every output, the named parity thresholds); the chunks in sequence on the delegate, each fed
the previous chunks' delegate outputs, against the whole torch model (the same thresholds). Each chunk is a
bundle component `<base>.k` (file, io, golden, int8 codes carried bit for bit); the manifest's `<base>_chunks`
block lists them with the whole model's inputs and golden (runtime/chunks.py).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from pocketdiff.errors import ParityError, PocketdiffError
from pocketdiff.runtime import parity as parity_lib
from pocketdiff.runtime.manifest_check import tflite_io
from pocketdiff.runtime.chunks import UNET, chain_on_delegate, chunk_name

from . import bundle as bundle_lib
from .exporter import Prepared, convert_job, prepare_component
from .text_encoder_chunks import split_text_encoder
from .unet_chunks import run_chunks, split_unet

COMPOSE_TOLERANCE = 1e-5  # the chunks in sequence vs the whole UNet in torch: max |diff| / max |reference|
REWRITE_COSINE = 0.9999  # the rewritten chunks in sequence vs the original UNet (as for a whole component's rewrites)


def _np(x: torch.Tensor) -> np.ndarray:
    return x.detach().to(torch.float32).cpu().numpy()


def _io_spec(tensors: dict) -> dict:
    return {n: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")} for n, v in tensors.items()}


def compose_check(original, rewritten, inputs: dict, reference: np.ndarray, base: str = UNET) -> tuple[list[dict], list[dict], dict]:
    """The original model's chunks in sequence must equal the whole model (torch); the rewritten chunks in
    sequence give each chunk's inputs and reference outputs (the residual stream rescaled between chunks as
    inside them), with their parity against the whole model: (inputs per chunk, outputs per chunk, parity)."""
    _, _, final = run_chunks(original, inputs)
    err = float(np.abs(_np(final) - reference).max()) / max(float(np.abs(reference).max()), 1e-12)
    if not err <= COMPOSE_TOLERANCE:
        raise PocketdiffError(f"{base}_chunks: the {len(original)} chunks in sequence differ from the whole {base} in torch "
                              f"(max |diff| {err:.3g} of the output's range > {COMPOSE_TOLERANCE})")
    feeds, outs, final = run_chunks(rewritten, inputs)
    m = parity_lib.metrics(reference, _np(final))
    if not m["cosine"] >= REWRITE_COSINE:
        raise ParityError(f"{base}: the rewritten chunks in sequence drifted from the original {base} (cosine {m['cosine']:.6f})")
    return feeds, outs, m


def chunk_prepared(chunk, feed: dict, outs: dict, whole: Prepared, out: Path, work: Path, base: str = UNET) -> Prepared:
    """A chunk ready to convert: its inputs, its reference outputs by name, its report row."""
    name = chunk_name(chunk.plan.index, base)
    report = {"file": f"{name}.tflite", "weights": whole.weights, "inputs": _io_spec(feed), "outputs": {},
              "stages": list(chunk.plan.stages), "chunk_params": chunk.plan.params}
    refs = {n: _np(v) for n, v in outs.items()}
    prep = Prepared(name, chunk.eval(), dict(feed), next(iter(refs.values())), report, out / f"{name}.tflite", whole.weights,
                    whole.quantized, raw_path=work / f"{name}_fp32.tflite", references_by_name=refs)
    return prep


def order_by_signature(prep: Prepared) -> None:
    """Declared outputs, golden output_J and output 0 in the converted file's signature order (its names)."""
    io = tflite_io(prep.raw_path)
    if io["shared_outputs"]:
        raise PocketdiffError(f"{prep.name}: the converter returns {' and '.join(io['shared_outputs'][0])} as one tensor, which runners "
                              "would read under one name only (the chunk must return each tensor once)")
    sig_outs = [o["name"] for o in io["outputs"]]
    refs = prep.references_by_name
    if set(sig_outs) != set(refs):
        raise PocketdiffError(f"{prep.name}: the converter named its outputs {sorted(sig_outs)}, the chunk returns {sorted(refs)}")
    prep.references = [refs[n] for n in sig_outs]
    prep.reference = prep.references[0]
    prep.report["outputs"] = {n: {"shape": list(refs[n].shape), "dtype": "float32"} for n in sig_outs}


def end_to_end_parity(paths: list[tuple[Path, list[str], dict]], inputs: dict, reference: np.ndarray, settings, base: str = UNET) -> dict:
    """The chunk files in sequence on the delegate (per precision) against the whole torch model."""
    feeds = {n: _np(v) if v.is_floating_point() else v.numpy() for n, v in inputs.items()}
    result, fails = {}, []
    for prec in settings.verify.precisions:
        y, _ = chain_on_delegate(paths, feeds, prec, driver=settings.verify.driver, timeout_s=settings.verify.timeout_s)
        m = result[prec] = parity_lib.metrics(reference, y)
        fails += parity_lib.check(f"{base} ({len(paths)} chunks end to end)", prec, m, settings.parity.for_precision(prec))
    if fails and settings.parity.enforce:
        raise ParityError("; ".join(fails))
    return result


def _split(base: str, rewritten, k: int, cut: str) -> list:
    """The chunk graphs of a prepared component's module (rewritten, or the original graph)."""
    if base == UNET:
        return split_unet(rewritten.unet, k, cut)
    return split_text_encoder(rewritten.text_encoder, k)


def export_chunked(ce, base: str, k: int, say) -> None:
    """`base` (unet | text_encoder) in `k` chunks. `ce`: the ComponentExport (export/export_components.py), `say`
    its progress line; fills its reports, manifest entries and `chunk_blocks[base]`."""
    cut = ce.cfg.unet_chunk_cut if base == UNET else "layer"
    graph, inputs = ce._graph_for(base)
    say(f"{base} ({ce.weights_of[base]}, {k} chunks): rewrites and PyTorch reference ...")
    whole = prepare_component(base, graph, inputs, ce.out / f"{base}.tflite", ce.rewrites_of[base], ce.weights_of[base], ce.quantized.get(base))
    chunks = _split(base, whole.rewritten, k, cut)
    feeds, outs, chain_parity = compose_check(_split(base, graph, k, cut), chunks, inputs, whole.reference, base)
    whole.report["chunks_rewrite_parity"] = chain_parity
    for chunk, feed, out in zip(chunks, feeds, outs):
        prep = chunk_prepared(chunk, feed, out, whole, ce.out, ce.work, base)
        say(f"{prep.name} ({', '.join(_short(chunk.plan.stages))}; {chunk.plan.params / 1e6:.1f} M parameters): converting with litert-torch ...")
        info = convert_job(prep.rewritten, prep.inputs, prep.raw_path)
        order_by_signature(prep)
        ce._finish(prep, info)
        prep.raw_path.unlink(missing_ok=True)
    del feeds, outs
    paths = [(ce.out / f"{chunk_name(c.plan.index, base)}.tflite", list(c.plan.inputs), dict(c.plan.aliases)) for c in chunks]
    parity = None
    if ce.cfg.verify.delegate:
        say(f"{base}: the {k} chunks in sequence on the GPU delegate against the whole torch {base} ...")
        parity = end_to_end_parity(paths, inputs, whole.reference, ce.cfg, base)
    ce.chunk_blocks[base] = _block(ce, whole, chunks, inputs, parity, base)


def _short(stages: list[str]) -> list[str]:
    """A chunk's stages for a progress line: a text encoder's run of layers as `encoder.layers.3-9`."""
    layers = [s for s in stages if s.startswith("encoder.layers.")]
    if len(layers) < 3:
        return stages
    ends = [s for s in stages if s not in layers]
    return [s for s in ends if s == "embeddings"] + [f"{layers[0]}-{layers[-1].rsplit('.', 1)[1]}"] + [s for s in ends if s != "embeddings"]


def _block(ce, whole: Prepared, chunks, inputs: dict, parity, base: str) -> dict:
    """The manifest's `<base>_chunks` block (and the whole model's golden file)."""
    names = [chunk_name(c.plan.index, base) for c in chunks]
    golden_path = ce.out / "golden" / f"{base}.npz"
    np.savez(golden_path, **{f"input_{n}": _np(v) if v.is_floating_point() else v.numpy() for n, v in inputs.items()},
             output_0=whole.reference)
    tol = {p: dataclasses.asdict(ce.cfg.parity.for_precision(p)) for p in ("fp16", "fp32")}
    outside = set.intersection(*(set(ce.reports[n].get("int8_layers_outside_graph") or []) for n in names))
    ce.reports[base] = {"file": None, "weights": whole.weights, "chunks": names,
                        "rewrites": whole.report.get("rewrites"), "rewrite_parity": whole.report.get("rewrite_parity"),
                        "chunks_rewrite_parity": whole.report.get("chunks_rewrite_parity"),
                        "end_to_end_parity": parity, "int8_layers_outside_graph": sorted(outside) if whole.weights == "int8" else None}
    return {
        "components": names,
        "inputs": [{"name": n, **spec} for n, spec in _io_spec(inputs).items()],
        "golden": {**bundle_lib.file_entry(ce.out, golden_path), "tolerances": tol},
        "stages": [list(c.plan.stages) for c in chunks],
        "params": [c.plan.params for c in chunks],
        "aliases": [dict(c.plan.aliases) for c in chunks],
        "parity": parity,
    }


def check_chunk_plans(cfg, pipe) -> None:
    """The chunk plans of `unet_chunks` / `text_encoder_chunks` on the loaded models (shapes only, milliseconds), so
    a plan the model cannot make is refused before the scan and every conversion (the UNet converts last)."""
    from .text_encoder_chunks import plan_text_encoder_chunks
    from .unet_chunks import plan_chunks

    if cfg.unet_chunks > 1 and UNET in cfg.components:
        plan_chunks(pipe.unet, cfg.unet_chunks, cfg.unet_chunk_cut)
    if cfg.text_encoder_chunks > 1 and "text_encoder" in cfg.components:
        plan_text_encoder_chunks(pipe.text_encoder, cfg.text_encoder_chunks)
