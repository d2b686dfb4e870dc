"""No tracked file names a place on the machine it was written on (issue 61).

What counts as a machine path, and why:
- Anywhere (code, scripts, configs, docs, results): a path under a working or home folder, `/work/...`, `/root/...`,
  `/home/USER/...`, `/Users/USER/...`. No user has them; a command or a record that names one says where an engineer's
  files lay, not where a user's are. Write the path relative to the repository (or to the folder a run worked in),
  or as `~/...`.
- In records only (configs, Markdown, `benchmarks/results/`, `docs/results/`): a path under `/tmp/`. There it is a
  record of where some run's files lay (`--output /tmp/x`, a bundle in `/tmp/sd21_bundles`); such a path is written
  relative (`runs/x`, `sd21_bundles/...`). In code a `/tmp/...` default is a scratch folder the code itself makes on
  a disposable machine (`scripts/gpu/*.sh`, benchmark defaults), like `tempfile`'s, and is allowed.
- Not machine paths: system locations every Debian-like system has (`/usr/bin/chromium`, `/usr/bin/time`, `/dev/shm`,
  `/proc/...`), paths inside URLs, and relative paths that merely contain such a segment (`.stage/tmp/stream.tar`,
  `~/.cache/...`): a path counts only where it starts, i.e. after a space, quote, `=`, `(`, `:` or a line's start.
This file itself names the patterns it looks for and is left out.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()
START = r"(?:(?<=\\[nt])|(?<![\w.~/:-]))"  # a path's first character: not inside a word, a relative path or a URL
# (after a JSON string's escaped newline or tab it is)
ANYWHERE = re.compile(START + r"/(?:work|root)/|" + START + r"/(?:home|Users)/[A-Za-z_][\w.-]*/")
RECORDS_ONLY = re.compile(START + r"/tmp/[\w.-]")
RECORD_DIRS = ("configs/", "benchmarks/results/", "docs/results/")


def is_record(path: str) -> bool:
    return path.startswith(RECORD_DIRS) or path.endswith(".md")


def machine_paths(path: str, text: str) -> list[str]:
    """`path:line: excerpt` for every machine path in `text` (the rules in this module's docstring)."""
    hits = []
    record = is_record(path)
    if not (ANYWHERE.search(text) or (record and RECORDS_ONLY.search(text))):
        return hits  # the whole text at once: most files have none
    for number, line in enumerate(text.splitlines(), 1):
        match = ANYWHERE.search(line) or (RECORDS_ONLY.search(line) if record else None)
        if match:
            hits.append(f"{path}:{number}: ...{line[max(0, match.start() - 40):match.end() + 40]}...")
    return hits


def tracked_text_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p and p != SELF]


def test_no_tracked_file_names_a_machine_path():
    hits = []
    for path in tracked_text_files():
        try:
            data = (ROOT / path).read_bytes()
        except (FileNotFoundError, IsADirectoryError):  # deleted in the working tree, or a submodule
            continue
        if b"\0" in data[:8192]:
            continue  # binary
        hits += machine_paths(path, data.decode("utf-8", errors="replace"))
    assert not hits, f"{len(hits)} machine paths (write them relative, see this test's docstring):\n" + "\n".join(hits[:40])


def test_the_patterns_catch_what_they_must_and_leave_the_rest():
    home, work, tmp = "/" + "home/ada/", "/" + "work/main/", "/" + "tmp/"
    assert machine_paths("benchmarks/x.py", f"p = '{work}benchmarks/x.py'")
    assert machine_paths("scripts/gpu/a.sh", f"cd {home}src")
    assert machine_paths("configs/sd21/export.yaml", f"#   pocketdiff export --output {tmp}bundle")
    assert machine_paths("benchmarks/results/r.json", f'"command": "run --bundle {tmp}sd21_bundles/a"')
    assert machine_paths("docs/MEASUREMENTS.md", f"({tmp}x)")
    assert machine_paths("benchmarks/results/r.json", '"stderr_tail": "Traceback\\n' + work + 'runtime/a.py"')
    assert not machine_paths("scripts/gpu/env.sh", f"RUNS={tmp}runs")  # code's own scratch folder
    assert not machine_paths("README.md", "apt-get install chromium (/usr/bin/chromium); ~/.cache/pocketdiff")
    assert not machine_paths("docs/x.md", "tar -cf .stage/tmp/stream.tar; https://example.org/tmp/a; runs/work/x")
    assert machine_paths("docs/x.md", f"x {tmp}a")[0].startswith("docs/x.md:1:")
