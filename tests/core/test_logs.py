"""Native (fd 2) logs go to a file; our own stderr lines stay on the terminal (issue 20)."""
import subprocess
import sys

SNIPPET = r"""
import os, sys
from pathlib import Path
from pocketdiff.logs import keep_native_log, native_logs_to_file
out = Path(sys.argv[1])
with native_logs_to_file() as log:
    os.write(2, b"INFO: Created TensorFlow Lite delegate for GPU.\n")  # what C++ code does
    os.write(1, b"INFO: Failed to load OpenCL library\n")
    print("export: unet: converting ...", file=sys.stderr)
    print("ours on stdout")
print("kept", keep_native_log(log, out))
os.write(2, b"after\n")
"""


def test_native_lines_go_to_the_output_folder_and_ours_to_the_terminal(tmp_path):
    r = subprocess.run([sys.executable, "-c", SNIPPET, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "export: unet: converting ..." in r.stderr and "after" in r.stderr
    assert "INFO:" not in r.stderr and "INFO:" not in r.stdout and "ours on stdout" in r.stdout
    log = tmp_path / "logs" / "native.log"
    assert "INFO: Created TensorFlow Lite delegate" in log.read_text() and "OpenCL" in log.read_text()
    assert f"kept {log}" in r.stdout


def test_empty_native_log_leaves_nothing(tmp_path):
    from pocketdiff.logs import keep_native_log, native_logs_to_file

    with native_logs_to_file() as log:
        pass
    assert keep_native_log(log, tmp_path) is None and log.closed and not (tmp_path / "logs").exists()


EXIT_SNIPPET = r"""
import atexit, os, sys
from pathlib import Path
from pocketdiff.logs import native_logs_until_exit
atexit.register(lambda: os.write(2, b"INFO: DestroyAccelerator at exit\n"))
native_logs_until_exit(Path(sys.argv[1]))
print("ours", file=sys.stderr)
"""


def test_native_lines_written_at_exit_go_to_the_log(tmp_path):
    log = tmp_path / "native.log"
    r = subprocess.run([sys.executable, "-c", EXIT_SNIPPET, str(log)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ours" in r.stderr and "INFO:" not in r.stderr, r.stderr
    assert "DestroyAccelerator at exit" in log.read_text()


FAILING_VERB = r"""
import atexit, os, sys, types
from pocketdiff import cli
from pocketdiff.errors import PocketdiffError

def main(args):
    os.write(2, b"INFO: Created TensorFlow Lite delegate for GPU.\n")  # native code, before the run fails
    atexit.register(lambda: os.write(2, b"INFO: DestroyAccelerator at exit\n"))
    raise PocketdiffError("bundle b: refused before --output was made")

sys.modules["failing_verb"] = types.SimpleNamespace(main=main)
cli.VERBS["run-bundle"] = "failing_verb"
sys.exit(cli.main())
"""


def test_a_failed_run_without_its_output_folder_leaves_no_native_log(tmp_path):
    """Issue 34: the native log of a run whose --output was never made stays out of the temp
    folder (and off the terminal: the error is the only line)."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    out = tmp_path / "out"
    env = {**__import__("os").environ, "TMPDIR": str(tmpdir)}
    r = subprocess.run([sys.executable, "-c", FAILING_VERB, "run-bundle", "b", "--prompt", "x", "--output", str(out)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == ["error: bundle b: refused before --output was made"], r.stderr
    assert "INFO:" not in r.stdout
    assert not out.exists() and list(tmpdir.iterdir()) == []
