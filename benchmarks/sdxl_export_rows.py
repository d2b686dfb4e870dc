"""Rows of an SDXL-size export on this machine (issue 63 item 4): per component its parameters, peak RSS, seconds,
bytes on disk and what the phone profile says, from the export's report.json when it finished, else from its
progress log and a timestamped RSS monitor (a run stopped at a deadline): the components it finished, with a
`finished` flag.

  python benchmarks/sdxl_export_rows.py --run 768:B768:export768.log:monitor768.txt:time768.txt [--run 1024:...] \
      --packed .devbundle/xl --out benchmarks/results/sdxl_export_koala700m_cpu.json [--note TEXT ...]

monitor.txt: lines `HH:MM:SS rss_kb=N lines=M last=...` every 10 s (the run's RSS, not its peak: a lower bound).
time.txt: GNU `time -v` of the export (its peak RSS, wall time), when it exited.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import sys
from pathlib import Path

START = re.compile(r"^export: (\S+?)(?: \(\w+\))?: rewrites and PyTorch reference")


def time_v(path: Path) -> dict:
    """GNU time -v's peak RSS (bytes), wall seconds and exit status, or {} before it exits."""
    text = path.read_text() if path.is_file() else ""
    out = {}
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    if m:
        out["peak_rss_bytes"] = int(m.group(1)) * 1024
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text)
    if m:
        secs = 0.0
        for part in m.group(1).split(":"):
            secs = secs * 60 + float(part)
        out["wall_s"] = round(secs, 1)
    m = re.search(r"Exit status: (\d+)", text)
    if m:
        out["exit_status"] = int(m.group(1))
    return out


def monitor_spans(log: Path, monitor: Path, day: dt.date) -> dict:
    """Per component: the first monitor sample after its start line, the first after the next one's (seconds
    within +-10 s), and the largest sampled RSS in between."""
    lines = log.read_text().splitlines() if log.is_file() else []
    starts = [(i + 1, m.group(1)) for i, ln in enumerate(lines) if (m := START.match(ln))]
    samples = []
    for ln in monitor.read_text().splitlines() if monitor.is_file() else []:
        m = re.match(r"(\d\d:\d\d:\d\d) rss_kb=(\d*) lines=(\d+)", ln)
        if m and m.group(2):
            t = dt.datetime.combine(day, dt.time.fromisoformat(m.group(1)), dt.timezone.utc)
            samples.append((t, int(m.group(2)) * 1024, int(m.group(3))))
    spans = {}
    for k, (line_no, name) in enumerate(starts):
        end_line = starts[k + 1][0] if k + 1 < len(starts) else None
        inside = [s for s in samples if s[2] >= line_no and (end_line is None or s[2] < end_line)]
        after = [s for s in samples if end_line is not None and s[2] >= end_line]
        if not inside:
            continue
        t0, t1 = inside[0][0], (after[0][0] if after else inside[-1][0])
        spans[name] = {"seconds": round((t1 - t0).total_seconds(), 1), "sampled_rss_max_bytes": max(s[1] for s in inside),
                       "finished": bool(after)}
    spans["_first_sample"] = samples[0][0].isoformat() if samples else None
    return spans


def component_rows(bundle: Path, report: dict | None, spans: dict) -> list[dict]:
    rows = []
    comps = (report or {}).get("components") or {}
    timings = (report or {}).get("timings") or {}
    for name in dict.fromkeys([*comps, *(n for n in spans if not n.startswith("_"))]):
        c, s = comps.get(name) or {}, spans.get(name) or {}
        secs = sum(timings.get(f"{name}_{step}_s") or 0 for step in ("prepare", "convert", "verify"))  # the tiled decode's parity: timings
        f = bundle / (c.get("file") or f"{name}.tflite")
        prof = c.get("device_profile") or {}
        rows.append({
            "component": name, "params": c.get("params"), "weights": c.get("weights"),
            "peak_rss_bytes": int(c["peak_rss_mb"] * 2**20) if c.get("peak_rss_mb") else None,
            "sampled_rss_max_bytes": s.get("sampled_rss_max_bytes"),
            "seconds": round(secs, 1) if secs else s.get("seconds"), "seconds_source": "report timings" if secs else "log + 10 s monitor",
            "bytes_on_disk": c.get("bytes") or (f.stat().st_size if f.is_file() else None),
            "phone_profile": {k: prof.get(k) for k in ("largest_tensor_mb", "largest_tensor", "largest_conv_input_mb",
                                                       "largest_fc_input_mb", "over_budget")} if prof else None,
            "fully_accelerated": c.get("fully_accelerated"),
            "finished": bool(c) or bool(s.get("finished")),
        })
    return rows


def run_rows(spec: str) -> dict:
    """RES:BUNDLE:LOG:MONITOR:TIME -> one run's block (its components' rows)."""
    res, bundle, log, monitor, tv_path = spec.split(":")
    bundle = Path(bundle)
    report = json.loads((bundle / "report.json").read_text()) if (bundle / "report.json").is_file() else None
    spans = monitor_spans(Path(log), Path(monitor), dt.datetime.now(dt.timezone.utc).date())
    return {
        "resolution": int(res), "finished": report is not None, "export_s": (report or {}).get("export_s"),
        "timings": (report or {}).get("timings"), "bundle_bytes": (report or {}).get("bundle_bytes"),
        "report_peak_rss_bytes": int(report["peak_rss_mb"] * 2**20) if report and report.get("peak_rss_mb") else None,
        "time_v": time_v(Path(tv_path)), "components": component_rows(bundle, report, spans),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="append", required=True, help="RES:BUNDLE:LOG:MONITOR:TIME (repeat per resolution)")
    p.add_argument("--config", default="configs/sdxl/export_koala700m_phone.yaml")
    p.add_argument("--packed", default=None, help="the benchmarks/sd21_bundle.py pack folder of these bundles")
    p.add_argument("--out", required=True)
    p.add_argument("--note", action="append", default=[])
    a = p.parse_args(argv)
    runs = [run_rows(r) for r in a.run]
    out = {
        "what": "pocketdiff export of the koala_700m SDXL preset (random tiled weights) with the phone preset on a 2-core / 24 GB machine",
        "command": f"nice -n 10 /usr/bin/time -v pocketdiff export --config {a.config} --output <bundle> [resolution=1024]",
        "preset": "koala_700m", "host_cpus": os.cpu_count(), "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "finished": all(r["finished"] for r in runs), "runs": runs, "notes": a.note,
    }
    if a.packed and (Path(a.packed) / "index.json").is_file():
        out["packed"] = {"path": a.packed, "bytes": json.loads((Path(a.packed) / "index.json").read_text()).get("bytes_packed")}
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    for r in runs:
        print(json.dumps({k: r[k] for k in ("resolution", "finished", "export_s", "bundle_bytes", "time_v")}))
        for c in r["components"]:
            print(f"  {c['component']}: params {c['params']} peak {c['peak_rss_bytes']} sampled {c['sampled_rss_max_bytes']} "
                  f"s {c['seconds']} bytes {c['bytes_on_disk']} finished {c['finished']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
