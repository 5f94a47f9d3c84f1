"""Where the step time of rebuilt LoRA inputs goes: one model, inputs rebuilt against inputs saved, under the profiler.

    python bench/profile_rebuild.py --out OUT                    # a GPU: the 1B shape (16 layers), sits + Liger
    python bench/profile_rebuild.py --model tiny --smoke --out OUT   # a CPU: checks the script

Each arm (``sits+liger`` and ``sits+liger+saved``, bench_model.py's) runs in this process one after the other
(Liger's patch undone in between), warms up, then profiles ``--steps`` steps. Per arm: the step time (CUDA events),
the host time to issue a step, the summed GPU kernel time, the number of kernel launches, and the GPU idle time
(step minus kernels: bubbles where the GPU waited for the host). Then the kernels whose summed time differs the
most between the arms. Writes OUT/profile_rebuild.json and prints a table. The question it answers: is the rebuild's
cost GPU work (more kernel time), or the GPU waiting on the host (more idle time)?
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_model import MODELS, build, liger_patch_undone  # noqa: E402


def profile_arm(model_name: str, arm: str, layers: int, batch: int, seq: int, warmup: int, steps: int) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with liger_patch_undone():
        model, params = build(model_name, arm, device, dtype, layers)
        model.train()
        # a frozen arm has nothing to train (its step is forward and backward alone)
        optimizer = torch.optim.AdamW(params, lr=1e-4, fused=device == "cuda") if params else None
        ids = torch.randint(0, MODELS[model_name]["vocab_size"], (batch, seq), device=device)

        def step():
            model(input_ids=ids, labels=ids).loss.backward()
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        for _ in range(warmup):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        step_s, host_s = [], []
        for _ in range(steps):
            start = time.perf_counter()
            if device == "cuda":
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
            step()
            host_s.append(time.perf_counter() - start)
            if device == "cuda":
                end.record()
                torch.cuda.synchronize()
                step_s.append(begin.elapsed_time(end) / 1000)
            else:
                step_s.append(time.perf_counter() - start)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            if device == "cuda":
                torch.cuda.synchronize()
    kernels: dict = defaultdict(float)
    launches = 0
    for event in prof.events():
        if device == "cuda" and event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] += event.device_time_total / 1e6 / steps
            launches += 1
    step_med = sorted(step_s)[len(step_s) // 2]
    kernel_s = sum(kernels.values())
    return {"arm": arm, "step_s": step_med, "host_s": sorted(host_s)[len(host_s) // 2],
            "kernel_s": kernel_s if device == "cuda" else None,
            "idle_s": step_med - kernel_s if device == "cuda" else None,
            "launches_per_step": launches / steps if device == "cuda" else None,
            "kernels": dict(kernels)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="1b")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--arms", nargs="+", default=["sits+liger", "sits+liger+saved"])
    parser.add_argument("--smoke", action="store_true", help="a CPU, the tiny shape, no Liger")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.layers, args.batch, args.seq, args.warmup, args.steps = "tiny", 2, 2, 32, 1, 2
        args.arms = ["sits", "sits+saved"]
    elif not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --smoke on a CPU)")
    rows = [profile_arm(args.model, arm, args.layers, args.batch, args.seq, args.warmup, args.steps)
            for arm in args.arms]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile_rebuild.json"), "w") as f:
        json.dump({"command": "python bench/profile_rebuild.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                   "rows": rows}, f, indent=1)
    for r in rows:
        extra = (f", kernels {r['kernel_s'] * 1e3:.1f} ms, GPU idle {r['idle_s'] * 1e3:.1f} ms, "
                 f"{r['launches_per_step']:.0f} launches" if r["kernel_s"] is not None else "")
        print(f"[{r['arm']}] step {r['step_s'] * 1e3:.1f} ms, host {r['host_s'] * 1e3:.1f} ms{extra}")
    if len(rows) >= 2 and rows[0]["kernels"]:  # the first two arms compared
        a, b = rows[0]["kernels"], rows[1]["kernels"]
        diff = sorted(set(a) | set(b), key=lambda k: -abs(a.get(k, 0) - b.get(k, 0)))[:12]
        print(f"kernels differing most ({rows[0]['arm']} minus {rows[1]['arm']}, ms per step):")
        for name in diff:
            print(f"  {(a.get(name, 0) - b.get(name, 0)) * 1e3:+8.3f}  {name[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
