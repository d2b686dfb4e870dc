"""`accelerate launch` on the CPU for the multi-process tests: --cpu runs one process; two need
--multi_gpu (torchrun) with ACCELERATE_USE_CPU set, which makes accelerate's state MULTI_CPU on gloo."""
from __future__ import annotations

import os
import socket
import subprocess
import sys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_cpu(n: int, *args: str, cwd=None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run `accelerate launch ... ARGS` with `n` CPU processes; asserts a zero exit (output in the message)."""
    env = dict(os.environ, ACCELERATE_USE_CPU="True", OMP_NUM_THREADS="1")
    mode = ["--cpu"] if n == 1 else ["--multi_gpu", "--main_process_port", str(_free_port())]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *mode, "--num_machines", "1", "--num_processes", str(n),
           "--dynamo_backend", "no", "--mixed_precision", "no", *args]
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc
