#!/usr/bin/env python
"""Where one model load's CPU time goes inside LiteRT, from a native py-spy profile (raw stacks) of
`bundle_footprint.py together MODEL` (scripts/gpu/load_parallel.sh takes it) and that run's JSON row (`code_at`:
where the LiteRT libraries were mapped). The accelerator library is stripped, so its hot spots are named by
address: the ranges below were read from the disassembly of ai-edge-litert 2.3.0's libLiteRtWebGpuAccelerator.so
(`objdump -d --start-address=...`): a scalar loop that dequantizes int8 weights to float32 (load, subtract the zero
point, convert, multiply by the scale, store), the library's own memcpy (non-temporal AVX stores) and memset.
Only the loading thread counts (the memory sampler's thread is left out).

  python benchmarks/load_profile.py --profile profile_warm.txt --row profile_warm.json --out summary.json
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path

ACCELERATOR = "libLiteRtWebGpuAccelerator.so"
# offsets into ai-edge-litert 2.3.0's libLiteRtWebGpuAccelerator.so (text), read from its disassembly
NAMED_RANGES = [
    (0x382000, 0x382200, "accelerator: int8 -> float32 weight dequantization loop"),
    (0x1157900, 0x1158180, "accelerator: memcpy (weights copied)"),
    (0x1158180, 0x1158400, "accelerator: memset (buffers zeroed)"),
]
SAMPLER_FRAMES = ("PeakSampler._poll", "GpuPeak._poll")


def _category(frame: str, base: int | None) -> str:
    lib = frame.rsplit("(", 1)[-1].rstrip(")") if "(" in frame else "?"
    if ACCELERATOR in frame and base is not None and frame.startswith("0x"):
        offset = int(frame.split()[0], 16) - base
        return next((name for lo, hi, name in NAMED_RANGES if lo <= offset < hi), "accelerator: other code")
    if "libnvidia" in lib:
        return "NVIDIA driver (" + lib.split("/")[-1].split(".so")[0] + ")"
    if "libLiteRt.so" in lib:
        return "LiteRT runtime (libLiteRt.so)"
    if "libc.so" in lib:
        return "libc (" + frame.split(" (")[0] + ")" if not frame.startswith("0x") else "libc (other)"
    if ".so" not in lib:
        return "Python (imports, the benchmark itself)"
    return "other (" + lib.split("/")[-1] + ")"


def summarize(profile: Path, row: dict) -> dict:
    base = next((int(v, 16) for k, v in (row.get("code_at") or {}).items() if k.endswith(ACCELERATOR)), None)
    opener = gzip.open if profile.suffix == ".gz" else open
    counts, total = collections.Counter(), 0
    with opener(profile, "rt") as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            if any(s in fr for fr in frames for s in SAMPLER_FRAMES):
                continue
            counts[_category(frames[-1], base)] += int(n)
            total += int(n)
    merged = collections.Counter()
    for name, n in counts.items():  # the small libc leaves together
        merged[name if n / max(total, 1) >= 0.01 or not name.startswith("libc") else "libc (other)"] += n
    return {"samples": total, "load_wall_s": row.get("load_wall_s"),
            "shares": [{"where": k, "samples": v, "share": round(v / total, 3)} for k, v in merged.most_common()]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", action="append", required=True, help="py-spy raw output (.txt or .txt.gz); repeatable")
    ap.add_argument("--row", action="append", required=True, help="the `together` JSON row of the same run; one per --profile")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if len(a.profile) != len(a.row):
        ap.error("give one --row per --profile")
    out = {}
    for prof, row_file in zip(a.profile, a.row):
        text = Path(row_file).read_text()
        row = json.loads(next(l for l in reversed(text.splitlines()) if l.startswith("{")))
        out[Path(prof).name.split(".")[0]] = summarize(Path(prof), row)
    Path(a.out).write_text(json.dumps(out, indent=1))
    for name, s in out.items():
        print(name, s["load_wall_s"], "s;", ", ".join(f"{r['where']} {r['share']:.0%}" for r in s["shares"][:8]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
