"""Where one layer step spends CPU and GPU time (torch.profiler), for the fused path and PEFT.

    python bench/profile_layer.py --d-in 4096 --d-out 4096 --r 16

Prints the profiler's table per arm; the launch-bound share is CPU time per step minus GPU time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_layer import layer_step  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--d-in", type=int, default=4096)
    parser.add_argument("--d-out", type=int, default=4096)
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--arms", nargs="+", default=["frozen", "peft", "sits:cublas"])
    args = parser.parse_args(argv)
    for arm in args.arms:
        _, _, full = layer_step(arm, args.d_in, args.d_out, args.r, args.tokens, torch.bfloat16, "cuda")
        for _ in range(5):
            full()
        torch.cuda.synchronize()
        n = 20
        t = time.perf_counter()
        for _ in range(n):
            full()
        cpu_ms = (time.perf_counter() - t) / n * 1000  # host time to issue one step (GPU may lag)
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t) / n * 1000
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                full()
            torch.cuda.synchronize()
        gpu_ms = sum(e.self_device_time_total for e in prof.key_averages()) / 5 / 1000
        print(f"== {arm}: host issue {cpu_ms:.3f} ms/step, wall {wall_ms:.3f} ms/step, GPU busy {gpu_ms:.3f} ms/step")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
