"""Compare the loss trajectories of two `pocketdiff distill` runs (e.g. 1 GPU vs 2 GPUs, same global batch).

    python benchmarks/distill_ddp_check.py --a outputs/distill-1gpu --b outputs/distill-2gpu --out ddp_check.json

Reads each run's logs.jsonl (phase = round name, step, loss) and report.json (wall time),
writes per-round max / mean absolute and relative differences of the logged losses, the
wall times and the speed ratio. Under bf16 the two runs are not bit-identical (different
reduction order of the gradient all-reduce), so the check is a tolerance, stated in the JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_losses(run: Path) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for line in (run / "logs.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip():
            rec = json.loads(line)
            out.setdefault(rec["phase"], {})[int(rec["step"])] = float(rec["loss"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, help="reference run folder (1 GPU)")
    p.add_argument("--b", required=True, help="run to compare (N GPUs)")
    p.add_argument("--out", required=True)
    p.add_argument("--rtol", type=float, default=0.05, help="tolerance on the mean relative loss difference per round")
    args = p.parse_args(argv)
    a, b = read_losses(Path(args.a)), read_losses(Path(args.b))
    rounds = {}
    ok = True
    for phase in sorted(set(a) & set(b)):
        steps = sorted(set(a[phase]) & set(b[phase]))
        if not steps:
            continue
        diffs = [abs(a[phase][s] - b[phase][s]) for s in steps]
        rels = [abs(a[phase][s] - b[phase][s]) / max(abs(a[phase][s]), 1e-12) for s in steps]
        mean_rel = sum(rels) / len(rels)
        rounds[phase] = {"steps_compared": len(steps), "max_abs": max(diffs), "mean_abs": sum(diffs) / len(diffs),
                         "max_rel": max(rels), "mean_rel": mean_rel, "within_tolerance": mean_rel <= args.rtol,
                         "first": [a[phase][steps[0]], b[phase][steps[0]]], "last": [a[phase][steps[-1]], b[phase][steps[-1]]]}
        ok &= mean_rel <= args.rtol
    train_s, sps = {}, {}
    for name, run in (("a", Path(args.a)), ("b", Path(args.b))):
        rep = json.loads((run / "report.json").read_text()) if (run / "report.json").is_file() else {}
        rs = rep.get("rounds", [])
        train_s[name] = sum(r.get("train_seconds", 0.0) for r in rs) or None
        sps[name] = {f"round-{r['round']}": r.get("samples_per_s") for r in rs}
    result = {"a": args.a, "b": args.b, "rtol": args.rtol, "rounds": rounds, "all_within_tolerance": ok and bool(rounds),
              "train_seconds": train_s, "samples_per_s": sps,
              "speedup_b_over_a": (train_s["a"] / train_s["b"]) if all(train_s.values()) else None}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if result["all_within_tolerance"] else 1


if __name__ == "__main__":
    sys.exit(main())
