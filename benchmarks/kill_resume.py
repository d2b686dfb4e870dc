"""Fault injection: SIGKILL the smoke recipes at seeded random points, resume, compare bit for bit.

    python benchmarks/kill_resume.py --points 20 --out kill_resume.json [--seed 0] [--stages train-teacher,prune]

For each stage (train-teacher, distill, calibrate, prune; `configs/smoke/VERB.yaml` with dotted
overrides that keep each run to seconds) the script

1. runs the recipe once, uninterrupted, as a subprocess on CPU, watching its output folder:
   the timeline of every path that appears (checkpoints, temporary folders, round folders,
   final files) and the wall time;
2. for each kill point (stages in turn, the point drawn from a seeded RNG): starts the same
   command in a fresh folder and SIGKILLs its process group
   - `path`: when a path of the reference timeline appears (a checkpoint, a temporary folder
     being written, a round folder, ...) plus a random delay of 0-0.3 s;
   - `time`: at a random fraction of the reference wall time (often before any checkpoint,
     or before the output folder even exists);
   - `early`: just after config.yaml appears (nothing to resume: resume starts from scratch),
     or while the interpreter is still importing (the output folder does not exist yet);
   and, for about one point in five, kills the resumed run a second time;
3. after each kill checks the folder: every checkpoint that `--resume latest` could pick is
   complete (safetensors headers cover their files, optimizer zips are whole, JSON parses),
   and lists final-named files that are torn (an incomplete run may hold them; the resume
   must replace them);
4. resumes with `--resume latest` in the same folder (never `--overwrite`) and compares every
   `*.safetensors` in the output folder (final weights, round folders, checkpoints, caches)
   with the reference bit for bit: every tensor's name, dtype, shape and raw bytes, and the
   file's metadata (sha256; not the file bytes, whose metadata order safetensors varies per
   process), naming the differing tensors when they differ.

calibrate has no checkpoints: `--resume latest` reruns it from the start in the same folder
(deterministic), which must give the same files.

The JSON tally (`--out`): points tried (points where a kill landed; a run that ends before its
trigger is drawn again), kills delivered, exact resumes, the same per stage, and one record per
point (triggers, when they fired, the checkpoints present, torn files seen).
Exit status 0 when every resume was exact and no run failed before its kill.

The CI test (tests/reliability/test_kill_resume.py) drives `run_point` on train-teacher with
smaller overrides (`--size ci`).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
POLL_S = 0.01

# Step counts small enough for seconds per run; checkpoints often enough to kill between them.
STAGES: dict[str, dict] = {
    "train-teacher": {
        "config": "configs/smoke/train-teacher.yaml",
        "full": ["data.shapes_count=32", "vae.steps=4", "vae.batch_size=8", "vae.checkpoint_every=2",
                 "train.max_steps=8", "train.batch_size=8", "train.checkpoint_every=2", "train.log_every=1",
                 "samples.steps=2"],
        "ci": ["data.shapes_count=16", "vae.steps=2", "vae.batch_size=4", "vae.checkpoint_every=1",
               "train.max_steps=4", "train.batch_size=4", "train.checkpoint_every=2", "train.log_every=1",
               "samples.steps=1", "samples.prompts=[a red circle]"],
    },
    "distill": {
        "config": "configs/smoke/distill.yaml",
        "full": ["data.shapes_count=16", "guided.train.max_steps=3", "guided.train.checkpoint_every=1",
                 "progressive.train.max_steps=3", "progressive.train.checkpoint_every=1"],
        "ci": ["data.shapes_count=8", "guided.train.max_steps=2", "guided.train.checkpoint_every=1",
               "progressive.start_steps=4", "progressive.train.max_steps=2", "progressive.train.checkpoint_every=1",
               "eval.enabled=false"],
    },
    "calibrate": {
        "config": "configs/smoke/calibrate.yaml",
        "full": ["recon.iters=10", "calib.num_prompts=2"],
        "ci": ["recon.iters=2", "calib.num_prompts=1", "output.samples=0", "output.rtn_pipeline=false"],
    },
    "prune": {
        "config": "configs/smoke/prune.yaml",
        "full": ["data.shapes_count=32", "prune.taylor.samples=8", "train.max_steps=6", "train.checkpoint_every=2",
                 "train.log_every=1", "eval.probe_samples=4", "eval.steps=2"],
        "ci": ["data.shapes_count=16", "prune.taylor.samples=4", "prune.taylor.batch_size=4", "train.max_steps=4",
               "train.batch_size=4", "train.checkpoint_every=2", "train.log_every=1", "eval.probe_samples=0",
               "eval.steps=1", "eval.prompts=[a red circle]"],
    },
}


def child_env() -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def command(stage: str, out: Path, size: str, resume: bool) -> list[str]:
    spec = STAGES[stage]
    cmd = [sys.executable, "-m", "pocketdiff", stage, "--config", str(REPO / spec["config"]), "--output", str(out)]
    if resume:
        cmd += ["--resume", "latest"]
    return cmd + list(spec[size])


# ------------------------------------------------------------------------------- files


MARKER = ".pocketdiff-output.json"  # pocketdiff.outputs.MARKER: a final file, though its name starts with a dot


def is_transient(rel: str) -> bool:
    """Temporary names (a checkpoint or folder being written): never compared, never final."""
    return any((p.startswith(".") and p != MARKER) or p.endswith(".tmp") for p in Path(rel).parts)


def walk(folder: Path) -> list[str]:
    """Every path under `folder` (files and folders), relative, sorted."""
    found = []
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            found.append(os.path.relpath(os.path.join(root, name), folder))
    return sorted(found)


def safetensors_problem(path: Path) -> Optional[str]:
    """None when the file's header parses and its data covers exactly what the header says."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{size} bytes, no header"
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                return f"header of {n} bytes in a {size}-byte file"
            meta = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in meta.items() if k != "__metadata__"), default=0)
        if 8 + n + end != size:
            return f"data ends at {8 + n + end}, file has {size} bytes"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def file_problem(path: Path) -> Optional[str]:
    """Whether a final-named file is torn (safetensors, torch zip, JSON); None when whole or unknown."""
    if path.suffix == ".safetensors":
        return safetensors_problem(path)
    try:
        if path.suffix in (".pt", ".pth"):
            if not zipfile.is_zipfile(path):
                return "not a whole zip archive"
            with zipfile.ZipFile(path) as z:
                bad = z.testzip()
            return f"bad member {bad}" if bad else None
        if path.suffix == ".json":
            json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        return f"{type(e).__name__}: {e}"
    return None


def check_killed_folder(out: Path) -> dict:
    """Torn files after a kill: in checkpoints `--resume latest` could choose (must be none),
    and other final-named files (allowed in an incomplete run; the resume must replace them)."""
    torn_ckpt, torn_other, complete = [], [], []
    if not out.is_dir():
        return {"torn_checkpoints": [], "torn_files": [], "complete_checkpoints": []}
    for rel in walk(out):
        p = out / rel
        if is_transient(rel) or not p.is_file():
            continue
        parts = Path(rel).parts
        in_ckpt = next((i for i, s in enumerate(parts) if s.startswith("checkpoint-")), None)
        if in_ckpt is not None:
            ckpt = out.joinpath(*parts[: in_ckpt + 1])
            if not (ckpt / "trainer_state.json").is_file():
                continue  # never chosen as latest
            if rel.endswith("trainer_state.json"):
                complete.append(str(ckpt.relative_to(out)))
        problem = file_problem(p)
        if problem:
            (torn_ckpt if in_ckpt is not None else torn_other).append(f"{rel}: {problem}")
    return {"torn_checkpoints": torn_ckpt, "torn_files": torn_other, "complete_checkpoints": sorted(complete)}


def tensors_digest(path: Path) -> str:
    """sha256 over a safetensors file's tensors (name, dtype, shape, raw bytes; sorted by name)
    and its metadata. Not the file's bytes: safetensors writes a metadata dict of more than one
    key in a per-process order (calibrate's int8 files), so equal contents can differ in bytes."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    h = hashlib.sha256(json.dumps(header.pop("__metadata__", None), sort_keys=True).encode())
    for name in sorted(header):
        info = header[name]
        start, end = info["data_offsets"]
        h.update(json.dumps([name, info["dtype"], info["shape"]]).encode())
        h.update(raw[8 + n + start : 8 + n + end])
    return h.hexdigest()


def weights(out: Path) -> dict[str, str]:
    """Content digest of every non-temporary *.safetensors under `out`."""
    digests = {}
    for rel in walk(out):
        if rel.endswith(".safetensors") and not is_transient(rel):
            digests[rel] = tensors_digest(out / rel)
    return digests


def tensor_diff(a: Path, b: Path, limit: int = 5) -> list[str]:
    """Which tensors differ between two safetensors files (for the report of a mismatch)."""
    try:
        from safetensors.torch import load_file

        x, y = load_file(str(a)), load_file(str(b))
    except Exception as e:  # noqa: BLE001 - diagnostics only
        return [f"unreadable: {type(e).__name__}: {e}"]
    out = [f"only in one: {k}" for k in sorted(set(x) ^ set(y))]
    for k in sorted(set(x) & set(y)):
        if x[k].dtype != y[k].dtype or x[k].shape != y[k].shape:
            out.append(f"{k}: {x[k].dtype}{tuple(x[k].shape)} vs {y[k].dtype}{tuple(y[k].shape)}")
        elif not bool((x[k] == y[k]).all()):
            out.append(f"{k}: max |diff| {float((x[k].double() - y[k].double()).abs().max()):.3g}")
    return out[:limit]


# ------------------------------------------------------------------------------- runs


@dataclass
class Reference:
    stage: str
    folder: Path
    wall_s: float
    timeline: list  # (seconds after start, relative path) of first appearance
    transient: set  # paths seen during the run that were gone at the end
    weights: dict


@dataclass
class Trigger:
    kind: str  # path | time | early
    path: Optional[str] = None
    at_s: float = 0.0  # time trigger; for path triggers, the fallback deadline
    delay_s: float = 0.0

    def describe(self) -> str:
        if self.kind == "time":
            return f"time {self.at_s:.2f}s"
        return f"{self.kind} {self.path} +{self.delay_s:.2f}s"


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the process and any worker it started
    except ProcessLookupError:
        pass
    proc.wait()


def _tail(log: Path, n: int = 3000) -> str:
    try:
        return log.read_bytes()[-n:].decode("utf-8", "replace")
    except OSError:
        return ""


def run_reference(stage: str, folder: Path, size: str, timeout: float = 900) -> Reference:
    """Uninterrupted run, watching the folder; raises when it fails."""
    out = folder / "out"
    log = folder / "log.txt"
    folder.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    proc = _spawn(command(stage, out, size, resume=False), log)
    seen: dict[str, float] = {}
    while proc.poll() is None:
        now = time.monotonic() - start
        if out.is_dir():
            for rel in walk(out):
                seen.setdefault(rel, now)
        if now > timeout:
            _kill(proc)
            raise RuntimeError(f"{stage}: reference run took over {timeout}s")
        time.sleep(POLL_S)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{stage}: reference run failed (exit {proc.returncode}):\n{_tail(log)}")
    final = set(walk(out))
    for rel in final:
        seen.setdefault(rel, wall)
    timeline = sorted((t, rel) for rel, t in seen.items())
    return Reference(stage, out, wall, timeline, {r for r in seen if r not in final}, weights(out))


def wait_and_kill(proc: subprocess.Popen, out: Path, trig: Trigger, start: float, timeout: float) -> Optional[float]:
    """Kill `proc` when `trig` fires; the seconds after start at the kill, or None when it exited first."""
    fired_at = None
    while proc.poll() is None:
        now = time.monotonic() - start
        if fired_at is None:
            if trig.kind == "time":
                hit = now >= trig.at_s
            else:
                hit = (out / trig.path).exists() or now >= trig.at_s
            if hit:
                fired_at = now
        if fired_at is not None and now >= fired_at + trig.delay_s:
            _kill(proc)
            return time.monotonic() - start
        if now > timeout:
            _kill(proc)
            raise RuntimeError(f"killed run exceeded {timeout}s without its trigger ({trig.describe()})")
        time.sleep(POLL_S)
    return None


def _log_size(log: Path) -> int:
    return log.stat().st_size if log.is_file() else 0


def _resumed_from(log: Path, offset: int) -> list[str]:
    """The "resumed from CHECKPOINT" lines a run printed (its part of the log, from `offset`)."""
    with open(log, "rb") as f:
        f.seek(offset)
        text = f.read().decode("utf-8", "replace")
    return [line.strip() for line in text.splitlines() if "resumed from" in line]


def run_point(ref: Reference, folder: Path, triggers: list[Trigger], size: str, timeout: float = 900) -> dict:
    """Kill at each trigger in turn (each on a `--resume latest` run after the first), then
    resume to the end and compare the weights with the reference. A point whose first run ends
    before its trigger is not killed (and not resumed); a resumed run that ends before its
    trigger is the resume that is compared."""
    out = folder / "out"
    log = folder / "log.txt"
    folder.mkdir(parents=True, exist_ok=True)
    rec: dict = {"stage": ref.stage, "kills": []}
    ckpts_before: list[str] = []  # complete checkpoints when the run starts (the folder is fresh)
    code = None
    for i, trig in enumerate(triggers):
        log_from = _log_size(log)
        start = time.monotonic()
        proc = _spawn(command(ref.stage, out, size, resume=i > 0), log)
        at = wait_and_kill(proc, out, trig, start, timeout)
        if at is None:
            rec["kills"].append({"trigger": trig.describe(), "delivered": False, "exit": proc.returncode})
            if proc.returncode != 0:
                rec.update(exact=False, error=f"run before the kill failed (exit {proc.returncode}): {_tail(log)}")
                return rec
            code = 0  # finished before the trigger: nothing more to interrupt
            break
        state = check_killed_folder(out)
        rec["kills"].append({
            "trigger": trig.describe(), "delivered": True, "at_s": round(at, 3), "resumed_run": i > 0,
            "resumed_from": _resumed_from(log, log_from) if i > 0 else [],
            "output_folder_existed": out.is_dir(),
            "checkpoints_at_kill": state["complete_checkpoints"],
            "before_first_checkpoint": not state["complete_checkpoints"] and not ckpts_before,
            "torn_checkpoints": state["torn_checkpoints"], "torn_files": state["torn_files"],
        })
        ckpts_before = state["complete_checkpoints"]
    delivered = [k for k in rec["kills"] if k["delivered"]]
    rec["killed"] = bool(delivered)
    if not delivered:
        return rec
    if code is None:  # the last run was killed: resume it to the end
        log_from = _log_size(log)
        start = time.monotonic()
        proc = _spawn(command(ref.stage, out, size, resume=True), log)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            code = "timeout"
    rec["resume_s"] = round(time.monotonic() - start, 3)
    rec["resumed_from"] = _resumed_from(log, log_from)
    problems = []
    if code != 0:
        problems.append(f"resume exited {code}: {_tail(log)}")
    else:
        got = weights(out)
        for rel in sorted(set(ref.weights) | set(got)):
            if rel not in got:
                problems.append(f"{rel}: missing after resume")
            elif rel not in ref.weights:
                problems.append(f"{rel}: not in the uninterrupted run")
            elif got[rel] != ref.weights[rel]:
                problems.append(f"{rel}: differs ({'; '.join(tensor_diff(ref.folder / rel, out / rel))})")
        if not (out / "report.json").is_file():
            problems.append("no report.json after resume")
        litter = [r for r in walk(out) if is_transient(r) and r.split(os.sep)[0] not in {p.split(os.sep)[0] for p in ref.transient}]
        rec["leftover_temporary"] = litter[:10]
    rec["torn_checkpoints"] = sorted({t for k in delivered for t in k["torn_checkpoints"]})
    if rec["torn_checkpoints"]:
        problems.append(f"torn checkpoint(s) selectable as latest: {rec['torn_checkpoints']}")
    rec["compared_files"] = len(ref.weights)
    rec["exact"] = not problems
    if problems:
        rec["problems"] = problems
    return rec


# ------------------------------------------------------------------------------- plan


def draw_triggers(ref: Reference, rng: random.Random) -> list[Trigger]:
    """A seeded kill point (one or, for about one point in five, two kills)."""
    # every path that appeared before the end (not report.json and its temporary file: nothing follows them)
    events = [(t, rel) for t, rel in ref.timeline if "report.json" not in rel and t < 0.98 * ref.wall_s]
    wall = ref.wall_s

    t_config = next((t for t, rel in ref.timeline if rel == "config.yaml"), wall)

    def one(first: bool) -> Trigger:
        kind = rng.choices(["path", "time", "early", "startup"],
                           weights=[0.5, 0.25, 0.15, 0.1] if first else [0.5, 0.5, 0.0, 0.0])[0]
        if kind == "startup":  # while importing: the output folder does not exist yet
            return Trigger("time", at_s=rng.uniform(0.3, 0.8) * t_config)
        if kind == "early" or not events:
            return Trigger("early", "config.yaml", at_s=wall, delay_s=rng.uniform(0.0, 1.0))
        if kind == "time":
            return Trigger("time", at_s=rng.uniform(0.05, 0.95) * wall * (1.0 if first else 0.7))
        t, rel = rng.choice(events)
        return Trigger("path", rel, at_s=t * 1.5 + 2.0, delay_s=rng.uniform(0.0, 0.3))

    triggers = [one(True)]
    if rng.random() < 0.2:
        triggers.append(one(False))
    return triggers


def tally(points: list[dict], refs: dict[str, Reference]) -> dict:
    killed = [p for p in points if p.get("killed")]
    per_stage = {}
    for stage in refs:
        mine = [p for p in killed if p["stage"] == stage]
        kills = [k for p in mine for k in p["kills"] if k["delivered"]]
        per_stage[stage] = {
            "points": len(mine), "exact_resumes": sum(p["exact"] for p in mine), "kills": len(kills),
            # calibrate has no checkpoints: n/a
            "kills_before_first_checkpoint": (sum(k["before_first_checkpoint"] for k in kills)
                                              if any("checkpoint-" in rel for _, rel in refs[stage].timeline) else None),
            "kills_before_output_folder": sum(not k["output_folder_existed"] for k in kills),
            "kills_of_resumed_runs": sum(k["resumed_run"] for k in kills),
            "kills_leaving_torn_final_files": sum(bool(k["torn_files"]) for k in kills),
            "reference_wall_s": round(refs[stage].wall_s, 2),
            "compared_safetensors": len(refs[stage].weights),
        }
    return {
        "points_tried": len(killed),
        "exact_resumes": sum(p["exact"] for p in killed),
        "kills_delivered": sum(s["kills"] for s in per_stage.values()),
        "points_not_killed": len(points) - len(killed),
        "per_stage": per_stage,
        "torn_checkpoints": sorted({t for p in killed for t in p.get("torn_checkpoints", [])}),
        "torn_final_files_after_kill": sorted({t.split(":")[0] for p in killed for k in p["kills"] if k["delivered"] for t in k["torn_files"]}),
        "failures": [{"stage": p["stage"], "kills": p["kills"], "problems": p.get("problems") or [p.get("error")]}
                     for p in points if p.get("killed") and not p["exact"] or p.get("error")],
    }


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", type=int, default=20, help="kill points to deliver across the stages")
    ap.add_argument("--out", required=True, help="JSON tally")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset of " + ",".join(STAGES))
    ap.add_argument("--size", choices=["full", "ci"], default="full", help="override set per stage")
    ap.add_argument("--work", default=None, help="work folder (default: a temporary one, removed at the end)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run")
    args = ap.parse_args(argv)
    stages = [s for s in args.stages.split(",") if s]
    for s in stages:
        if s not in STAGES:
            ap.error(f"unknown stage {s!r}; choose from {', '.join(STAGES)}")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="kill_resume-"))
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    started = time.time()
    refs: dict[str, Reference] = {}
    for s in stages:
        t0 = time.time()
        refs[s] = run_reference(s, work / "ref" / s, args.size, args.timeout)
        print(f"[reference] {s}: {refs[s].wall_s:.1f}s, {len(refs[s].weights)} safetensors, "
              f"{len(refs[s].timeline)} paths ({time.time() - t0:.0f}s)", flush=True)
    points: list[dict] = []
    order = stages[:]
    attempts = 0
    while sum(p.get("killed", False) for p in points) < args.points and attempts < 3 * args.points:
        stage = order[attempts % len(order)]
        attempts += 1
        triggers = draw_triggers(refs[stage], rng)
        folder = work / "points" / f"{attempts:03d}-{stage}"
        rec = run_point(refs[stage], folder, triggers, args.size, args.timeout)
        rec["point"] = attempts
        points.append(rec)
        kills = ", ".join(f"{k['trigger']}" + (f" @ {k['at_s']:.1f}s" if k["delivered"] else " (exited first)") for k in rec["kills"])
        verdict = "exact" if rec.get("exact") else "MISMATCH " + "; ".join(rec.get("problems") or [rec.get("error", "")])[:800]
        print(f"[point {attempts}] {stage}: {kills} -> {verdict if rec.get('killed') else 'not killed'}", flush=True)
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    result = {
        "benchmark": "kill_resume", "seed": args.seed, "size": args.size, "stages": stages,
        **tally(points, refs),
        "wall_time_s": round(time.time() - started, 1),
        "overrides": {s: STAGES[s][args.size] for s in stages},
        "points": points,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"{result['exact_resumes']}/{result['points_tried']} exact resumes; "
          + ", ".join(f"{s}: {v['exact_resumes']}/{v['points']}" for s, v in result["per_stage"].items())
          + f"; {result['wall_time_s']}s -> {args.out}")
    if not args.keep and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    # a point whose run failed before its kill is a failure too (it is not among the points tried)
    return 0 if result["points_tried"] and not result["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
