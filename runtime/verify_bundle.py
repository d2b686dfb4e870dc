"""`pocketdiff verify-bundle BUNDLE [--accelerator gpu|cpu]`: is this bundle good on this machine?

Needs only the bundle, numpy and ai-edge-litert (no torch: a GPU machine or phone-lab box with
just the runtime can run it). Per component, in order, each a named check:

  manifest   the fields and types a runner reads (`manifest_check.manifest_problems`)
  files      every listed file present, sha256 equal, the .tflite complete
  io         input/output names, shapes and dtypes of the .tflite equal the manifest's
  golden     the golden .npz matches the manifest's io and is finite
  compile    the model compiles on the accelerator
  delegate   (gpu) every op on the GPU delegate (`is_fully_accelerated()`)
  finite     the output on the golden inputs has no NaN/Inf, at each precision
  parity     cosine / PSNR vs the golden output within the manifest's tolerances (fp16 =
             the delegate's default precision, fp32 = enforce_f32; cpu: the fp32 tolerances)

The first failure raises `BundleCheckError` (the CLI exits 2: "verify-bundle: unet: delegate:
..."); `--keep-going` checks everything and fails at the end naming every failure. Compile time
and latency per component and precision go into the report (`--json FILE` writes it).
`pocketdiff export` runs the checks that need no delegate run on the bundle it wrote.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np


from pocketdiff.errors import PocketdiffError

from .manifest_check import manifest_problems
from .chunks import CHUNKABLE, base_of, block_key, chain_on_delegate, chunk_aliases

ACCELERATORS = ("gpu", "cpu")
_CHECK_OF = {"signature": "io", "present": "files", "size": "files", "path": "files", "file": "files"}


class BundleCheckError(PocketdiffError):
    """A bundle failed one named check of one component."""

    def __init__(self, component: str, check: str, detail: str):
        self.component, self.check, self.detail = component, check, detail
        super().__init__(f"{component}: {check}: {detail}")


def _problem_error(man: dict, p) -> BundleCheckError:
    """issue 21's manifest_check.Problem -> the component it concerns and a verify-bundle check."""
    comp = "manifest"
    for name, entry in (man.get("components") or {}).items():
        golden = entry.get("golden") or {}
        if p.where.startswith(f"components.{name}") or p.where in (entry.get("path"), golden.get("path")):
            comp = name
    if p.where.startswith("tokenizer"):
        comp = "tokenizer"
    is_file = "/" in p.where or p.where.endswith((".tflite", ".npz", ".npy", ".json", ".txt"))
    check = _CHECK_OF.get(p.check, "manifest") if is_file else "manifest"
    return BundleCheckError(comp, check, f"{p.where}: {p.message} ({p.check} check)")


def load_golden(name: str, entry: dict) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(inputs by manifest name, reference output) of a component's golden file, checked
    against the manifest's io."""
    golden = entry.get("golden")
    if not golden or "_path" not in golden:
        raise BundleCheckError(name, "golden", "the manifest lists no golden file")
    try:
        data = np.load(golden["_path"], allow_pickle=False)
    except (OSError, ValueError) as e:
        raise BundleCheckError(name, "golden", f"{golden.get('path')} does not load ({type(e).__name__}: {e})") from None
    with data:
        inputs = {}
        for i in entry["inputs"]:
            key = f"input_{i['name']}"
            if key not in data.files:
                raise BundleCheckError(name, "golden", f"{golden.get('path')} has no {key}")
            a = data[key]
            if list(a.shape) != list(i["shape"]):
                raise BundleCheckError(name, "golden", f"{key} has shape {list(a.shape)}, manifest says {i['shape']}")
            inputs[i["name"]] = a
        if "output_0" not in data.files:
            raise BundleCheckError(name, "golden", f"{golden.get('path')} has no output_0")
        ref = data["output_0"]
    if list(ref.shape) != list(entry["outputs"][0]["shape"]):
        raise BundleCheckError(name, "golden", f"output_0 has shape {list(ref.shape)}, manifest says {entry['outputs'][0]['shape']}")
    if not np.isfinite(ref).all():
        raise BundleCheckError(name, "golden", "the reference output holds NaN/Inf")
    return inputs, ref


def _load(bundle: Path, verify_sha: bool) -> dict:
    from .bundle import load_manifest

    try:
        man = load_manifest(bundle, verify_sha=False)  # structure and paths; sha256 per component below
    except PocketdiffError as e:  # name the component whose file is at fault when the message does
        msg = str(e)
        import re

        m = re.search(r"(?:component|golden of) ([A-Za-z0-9_.]*[A-Za-z0-9_])", msg)
        raise BundleCheckError(m.group(1) if m else "manifest", "files", msg) from None
    return man


def _check_files(name: str, entry: dict, verify_sha: bool) -> None:
    from .tflite_file import check_tflite_file, sha256_file

    for what, e in (("model", entry), ("golden", entry.get("golden"))):
        if not e:
            continue
        path = Path(e["_path"])
        if not path.is_file():
            raise BundleCheckError(name, "files", f"{e.get('path')} is missing")
        if verify_sha:
            got = sha256_file(path)
            if got != e.get("sha256"):
                raise BundleCheckError(name, "files", f"sha256 of {e.get('path')} ({what}) is {got[:12]}..., manifest says {str(e.get('sha256'))[:12]}...")
    try:
        check_tflite_file(entry["_path"])
    except PocketdiffError as e:
        raise BundleCheckError(name, "files", str(e)) from None


def verify_component(name: str, entry: dict, accelerator: str = "gpu", precisions: Sequence[str] = ("fp16", "fp32"),
                     run: bool = True, verify_sha: bool = True, timeout_s: float = 1800.0, repeats: int = 3,
                     driver: Optional[str] = None, cpu_int8_as_fp16: bool = True) -> dict:
    """Every check of one component (see the module docstring); returns its report. On the CPU
    an int8 component runs as its fp16-storage variant (runtime/cpu_variant.py) unless
    `cpu_int8_as_fp16` is false."""
    from . import parity as parity_lib
    from .delegate import run_on_delegate

    rep: dict = {"checks": []}
    _check_files(name, entry, verify_sha)
    rep["checks"].append("files")
    rep["checks"].append("io")  # the .tflite signature: checked with the manifest (verify_bundle)
    inputs, ref = load_golden(name, entry)
    rep["checks"].append("golden")
    if not run:
        return rep
    tol = entry["golden"].get("tolerances", {})
    precs = list(precisions) if accelerator == "gpu" else ["fp32"]
    t0 = time.perf_counter()
    model_path = entry["_path"]
    tmp = None
    if accelerator == "cpu" and cpu_int8_as_fp16 and entry.get("weights") == "int8":
        import tempfile

        from .cpu_variant import fp16_variant

        tmp = tempfile.TemporaryDirectory(prefix="pocketdiff-cpu-")
        model_path = str(Path(tmp.name) / Path(model_path).name)
        rep["cpu_variant"] = {"weights": "fp16 (from int8)", "tensors": fp16_variant(entry["_path"], model_path),
                              "build_s": round(time.perf_counter() - t0, 2)}
    try:
        r = run_on_delegate(model_path, inputs, precisions=precs, accelerator=accelerator, repeats=repeats, warmup=1,
                            timeout_s=timeout_s, driver=driver)
    finally:
        if tmp is not None:
            tmp.cleanup()
    rep.update(accelerator=accelerator, driver=r.driver, adapter=r.adapter, wall_s=round(time.perf_counter() - t0, 2),
               compile_s={k: round(v, 3) for k, v in r.compile_s.items()},
               latency_ms={k: round(1000 * v, 3) for k, v in r.latency_s.items()},
               memory=r.memory)  # measured in the delegate's process: host RSS / peak, GPU where NVML tells it
    if not r.compiled:
        raise BundleCheckError(name, "compile", r.error or "the model did not compile")
    rep["checks"].append("compile")
    if accelerator == "gpu":
        rep["fully_accelerated"] = r.fully_accelerated
        if r.ops_split:
            rep["ops_split"] = list(r.ops_split)
        if not r.fully_accelerated:
            raise BundleCheckError(name, "delegate", f"not fully accelerated on the GPU delegate ({r.driver}): {r.rejected_summary()}")
        rep["checks"].append("delegate")
    refs = _in_run_order(_chunk_references(name, entry), entry, r.output_names) or [ref]  # a UNet chunk: every output
    rep["parity"] = {}
    for p in precs:
        if p not in r.outputs:
            raise BundleCheckError(name, "compile", f"no {p} output: {r.error or 'the run ended early'}")
        for j, want in enumerate(refs):
            m = parity_lib.metrics(want, r.outputs[p][j])
            if j == 0 or m["cosine"] < rep["parity"][p]["cosine"] or not m["finite"]:
                rep["parity"][p] = m
            check_parity(name, p, m, tol, f"the {accelerator} {p} output{f' {j}' if len(refs) > 1 else ''}", len(refs) > 1)
    rep["checks"] += ["finite", "parity"]
    return rep


def check_parity(name: str, p: str, m: dict, tol: dict, what: str, say_what: bool = True) -> None:
    """`m` (parity.metrics) against the manifest's tolerances at precision `p`: BundleCheckError otherwise."""
    from . import parity as parity_lib

    if not m["finite"]:
        raise BundleCheckError(name, "finite", f"{m['nonfinite']} NaN/Inf values in {what}")
    th = tol.get(p)
    if th is None:
        raise BundleCheckError(name, "parity", f"the manifest has no {p} tolerances")
    fails = parity_lib.check(name, p, m, parity_lib.Thresholds(float(th["cosine_min"]), float(th["psnr_min_db"])))
    if fails:
        raise BundleCheckError(name, "parity", "; ".join(f.split(": ", 1)[-1] for f in fails) + (f" ({what})" if say_what else ""))


def _in_run_order(refs: list, entry: dict, run_names: Sequence[str]) -> list:
    """Golden outputs (declared order: the file's signature_def, by name) in the order the runtime returns them (its
    signature list: the graph's order), matched by name; they differ when the names do not sort in the graph's order
    (an SDXL UNet's unet.0 returns `emb` after its skip connections)."""
    declared = [o["name"] for o in entry["outputs"]]
    if len(refs) < 2 or sorted(run_names) != sorted(declared):
        return refs
    return [refs[declared.index(n)] for n in run_names]


def _chunk_references(name: str, entry: dict) -> list:
    """A chunk's golden outputs in the declared (signature) order, or those of a whole component whose outputs are
    several roles (SDXL's text_encoder_2: states and pooled embedding); empty for other components."""
    from .components import REGISTRY

    several_roles = name in REGISTRY and len(REGISTRY[name].output_roles) > 1
    if (base_of(name) == name and not several_roles) or len(entry["outputs"]) < 2:
        return []
    with np.load(entry["golden"]["_path"], allow_pickle=False) as data:
        keys = [f"output_{j}" for j in range(len(entry["outputs"]))]
        missing = [k for k in keys if k not in data.files]
        if missing:
            raise BundleCheckError(name, "golden", f"{entry['golden'].get('path')} has no {', '.join(missing)}")
        return [data[k] for k in keys]


def verify_chunk_chain(man: dict, accelerator: str, precisions: Sequence[str], timeout_s: float, driver: Optional[str],
                       base: str) -> dict:
    """A chunked model (`base`: unet, text_encoder) end to end: the chunks in sequence (each fed the previous
    chunks' outputs on this accelerator) against the whole model's golden output, at the manifest's tolerances."""
    from . import parity as parity_lib

    block = man[block_key(base)]
    golden = block.get("golden") or {}
    if "_path" not in golden:
        raise BundleCheckError(base, "golden", f"the {block_key(base)} block lists no golden file")
    with np.load(golden["_path"], allow_pickle=False) as data:
        inputs = {i["name"]: data[f"input_{i['name']}"] for i in block["inputs"]}
        ref = data["output_0"]
    paths = [(man["components"][n]["_path"], [i["name"] for i in man["components"][n]["inputs"]], a)
             for n, a in zip(block["components"], chunk_aliases(man, base))]
    rep: dict = {"checks": ["chain"], "chunks": list(block["components"]), "parity": {}}
    for p in (list(precisions) if accelerator == "gpu" else ["fp32"]):
        try:
            y, _ = chain_on_delegate(paths, inputs, p, accelerator=accelerator, timeout_s=timeout_s, driver=driver)
        except PocketdiffError as e:
            raise BundleCheckError(base, "compile", str(e)) from None
        m = rep["parity"][p] = parity_lib.metrics(ref, y)
        check_parity(base, p, m, golden.get("tolerances", {}), f"the {len(paths)} chunks in sequence, {accelerator} {p}")
    rep["checks"] += ["finite", "parity"]
    return rep


def verify_bundle(bundle: str | Path, accelerator: str = "gpu", precisions: Sequence[str] = ("fp16", "fp32"),
                  components: Optional[Sequence[str]] = None, run: bool = True, verify_sha: bool = True,
                  keep_going: bool = False, timeout_s: float = 1800.0, repeats: int = 3, driver: Optional[str] = None,
                  cpu_int8_as_fp16: bool = True) -> dict:
    """Check a bundle; raises BundleCheckError on the first failure (keep_going: returns the
    report with `ok` false and every failure listed)."""
    if accelerator not in ACCELERATORS:
        raise PocketdiffError(f"accelerator must be one of {ACCELERATORS}, got {accelerator!r}")
    for p in precisions:
        if p not in ("fp16", "fp32"):
            raise PocketdiffError(f"precision must be fp16 or fp32, got {p!r}")
    bundle = Path(bundle)
    t_start = time.perf_counter()
    man = _load(bundle, verify_sha)
    comps = man["components"]
    names = list(components) if components else list(comps)
    for n in names:
        if n not in comps:
            raise BundleCheckError(n, "manifest", f"not in the bundle (it has {sorted(comps)})")
    # issue 21's checks: fields, io contract, sizes, every .tflite's signature; per component
    by_comp: dict[str, list[BundleCheckError]] = {}
    for prob in manifest_problems(bundle, man, need=(), files=True):
        e = _problem_error(man, prob)
        by_comp.setdefault(e.component, []).append(e)
    for n, errs in by_comp.items():
        if n not in comps:  # a bundle-wide problem (a manifest field, the tokenizer): nothing is worth running
            raise errs[0]
    report: dict = {"bundle": str(bundle.resolve()), "accelerator": accelerator, "precisions": list(precisions),
                    "components": {}, "failures": []}
    for n in names:
        try:
            if by_comp.get(n):
                raise by_comp[n][0]
            report["components"][n] = verify_component(n, comps[n], accelerator, precisions, run, verify_sha, timeout_s, repeats, driver,
                                                          cpu_int8_as_fp16)
            report["components"][n]["ok"] = True
        except BundleCheckError as e:
            report["components"][n] = {"ok": False, "failed_check": e.check, "error": e.detail}
            report["failures"].append(str(e))
            if not keep_going:
                raise
    _verify_chain_into(report, man, names, run, accelerator, precisions, timeout_s, driver, keep_going)
    report["bytes"] = {n: int(comps[n].get("bytes") or Path(comps[n]["_path"]).stat().st_size) for n in names}
    report["wall_s"] = round(time.perf_counter() - t_start, 2)
    report["ok"] = not report["failures"]
    return report


def _verify_chain_into(report: dict, man: dict, names: list, run: bool, accelerator: str, precisions, timeout_s: float,
                       driver: Optional[str], keep_going: bool) -> None:
    """With every chunk of a chunked model checked and passed: the chunks end to end, as report["components"][base]
    (base: unet, text_encoder)."""
    for base in CHUNKABLE:
        chunks = (man.get(block_key(base)) or {}).get("components") or []
        if run and chunks and all(report["components"].get(n, {}).get("ok") for n in chunks):
            _verify_one_chain(report, man, base, accelerator, precisions, timeout_s, driver, keep_going)


def _verify_one_chain(report: dict, man: dict, base: str, accelerator: str, precisions, timeout_s: float, driver: Optional[str],
                      keep_going: bool) -> None:
    try:
        report["components"][base] = {**verify_chunk_chain(man, accelerator, precisions, timeout_s, driver, base), "ok": True}
    except BundleCheckError as e:
        report["components"][base] = {"ok": False, "failed_check": e.check, "error": e.detail}
        report["failures"].append(str(e))
        if not keep_going:
            raise


def main(args) -> int:
    """CLI entry (bundle, accelerator, precisions, components, json, no_run, keep_going, timeout, debug)."""
    from .cli_checks import check_verify_bundle_flags

    check_verify_bundle_flags(args)  # --timeout a positive number, --json outside the bundle: before any check runs
    precisions = [p for p in args.precisions.split(",") if p]
    components = [c for c in args.components.split(",") if c] if args.components else None
    try:
        report = verify_bundle(args.bundle, args.accelerator, precisions, components, run=not args.no_run,
                               keep_going=args.keep_going, timeout_s=args.timeout, cpu_int8_as_fp16=not args.cpu_int8_as_is)
    except BundleCheckError as e:
        raise PocketdiffError(f"verify-bundle: {e}") from None
    if args.json:
        from pocketdiff.outputs import write_json

        write_json(Path(args.json), report)
    if report["failures"]:
        raise PocketdiffError(f"verify-bundle: {len(report['failures'])} failed: " + " | ".join(report["failures"]))
    for n, r in report["components"].items():
        if not r.get("ok"):
            print(f"{n}: FAILED {r.get('failed_check')}: {r.get('error')}")
            continue
        lat = ", ".join(f"{p} {ms:.1f} ms" for p, ms in r.get("latency_ms", {}).items())
        comp = ", ".join(f"{p} {s:.1f} s" for p, s in r.get("compile_s", {}).items())
        fa = f", fully accelerated {r['fully_accelerated']}" if "fully_accelerated" in r else ""
        cos = ", ".join(f"{p} cos {m['cosine']:.5f}" for p, m in r.get("parity", {}).items())
        mem = r.get("memory") or {}
        gpu = f" + GPU {mem['gpu_peak_mb']:.0f} MB" if mem.get("gpu_peak_mb") is not None else ""
        peak = f"; peak host {mem['host_peak_mb']:.0f} MB{gpu}" if mem.get("host_peak_mb") is not None else ""
        print(f"{n}: ok ({'/'.join(r['checks'])}){fa}; compile {comp or '-'}; latency {lat or '-'}{peak}; {cos}".rstrip("; "))
    print(f"verify-bundle: {report['bundle']} ok on {args.accelerator} in {report['wall_s']:.1f} s")
    return 0
