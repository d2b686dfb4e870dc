#!/usr/bin/env python
"""All-reduce bandwidth between the GPUs of one machine, through torch.distributed (NCCL), as DDP
uses it for the gradients: what bounds the trainer's weak scaling when the all-reduce cannot hide
behind the backward (the SD-2.1 UNet's gradients are 3.46 GB in float32, 1.73 GB in bf16).

  torchrun --nproc_per_node 2 benchmarks/allreduce_bw.py --out allreduce.json [--mb 25,100,1024]

Per size and dtype: the median time of --iters all-reduces after --warmup, the algorithm
bandwidth (bytes / time) and the bus bandwidth (algorithm x 2(n-1)/n, NCCL's tests' convention,
comparable across GPU counts). Rank 0 writes the JSON (with the NCCL version and the GPUs).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--mb", default="25,100,1024", help="message sizes in MiB, comma separated")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        for mb in (float(m) for m in args.mb.split(",")):
            n = int(mb * 2**20) // torch.empty((), dtype=dtype).element_size()
            x = torch.ones(n, dtype=dtype, device="cuda")
            times = []
            for i in range(args.warmup + args.iters):
                torch.cuda.synchronize()
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(x)
                torch.cuda.synchronize()
                if i >= args.warmup:
                    times.append(time.perf_counter() - t0)
            s = statistics.median(times)
            algbw = n * x.element_size() / s / 1e9
            rows.append({"dtype": name, "mib": mb, "median_s": s, "algbw_gb_s": algbw, "busbw_gb_s": algbw * 2 * (world - 1) / world})
            if rank == 0:
                print(f"[allreduce] {name} {mb:g} MiB: {s * 1e3:.2f} ms, bus {rows[-1]['busbw_gb_s']:.1f} GB/s", flush=True)
            del x
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "benchmark": "allreduce_bw", "world": world, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "torch": torch.__version__, "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "rows": rows}, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
