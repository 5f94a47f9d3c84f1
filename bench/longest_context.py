"""The longest context that trains under a memory cap: bs 1, a Llama-3 shape, per arm.

    python bench/longest_context.py --plan --out OUT                 # a CPU: plan_memory's answer, in seconds
    python bench/longest_context.py --measure --out OUT              # a GPU: measured, starting from the plan
    python bench/longest_context.py --plan --smoke --out OUT         # a CPU: the tiny shape, checks the script

The memory is capped at ``--cap-gib`` (80 by default, so that figures compare with published 80 GB results;
``torch.cuda.set_per_process_memory_fraction`` on a GPU). The answer is the longest multiple of ``--step``
(1024) tokens at which one training step (forward, backward, fused AdamW) fits, found by bisection; with
``--measure`` each arm runs in its own process that builds the model once, probes sequence lengths from the
plan's answer outwards (an out-of-memory step is caught, the cache emptied, the next length tried), and times
one more step at the answer for tokens/s. A probe slower than ``--probe-timeout`` seconds ends the arm's
search there (attention grows with the square of the context). Arms are bench_model.py's (random bf16
weights, sdpa, LoRA r16 on the seven projections); "+gc" is gradient checkpointing (non-reentrant).
Writes OUT/longest_context.json, .csv and .png.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_model import MODELS, build, liger_patch_undone  # noqa: E402
from harness import png, print_table, write_results  # noqa: E402

ARMS = ["frozen+liger", "sits+liger", "sits+liger+saved", "sits+liger+gc", "peft", "peft+gc"]
GIB = 2**30


def bisect(fits, low: int, high: int, step: int) -> int:
    """The largest multiple of ``step`` in [low, high] for which ``fits`` holds, given that fits(low) holds and
    fits is monotone (0 when even ``low`` does not fit)."""
    if not fits(low):
        return 0
    lo, hi = low // step, high // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * step):
            lo = mid
        else:
            hi = mid - 1
    return lo * step


def planned_longest(model_name: str, arm: str, cap_bytes: float, step: int, max_tokens: int, layers: int = 0) -> dict:
    """plan_memory's longest context for ``arm`` under ``cap_bytes`` (a CPU, the meta device)."""
    from sits_lora import plan_memory

    with liger_patch_undone():
        model, params = build(model_name, arm, "meta", torch.bfloat16, layers)
        optimizer = "adamw" if params else "none"
        gc = "gc" in arm.split("+")

        def fits(seq: int) -> bool:
            return plan_memory(model, 1, seq, gradient_checkpointing=gc, optimizer=optimizer).total <= cap_bytes

        longest = bisect(fits, step, max_tokens, step)
        at = plan_memory(model, 1, longest or step, gradient_checkpointing=gc, optimizer=optimizer)
    return {"arm": arm, "planned_tokens": longest, "planned_gib_at_it": at.total / GIB,
            "hit_search_limit": longest >= max_tokens}


# ----------------------------------------------------------------------------- measuring (a GPU)


def worker(args) -> None:
    """One arm: build once, probe from the planned length outwards, print RESULT json."""
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(args.cap_gib * GIB / total, 1.0))
    model, params = build(args.model, args.arm, "cuda", torch.bfloat16, args.layers)
    model.train()
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True) if params else None
    vocab = MODELS[args.model]["vocab_size"]
    probes = []

    def one_step(seq: int) -> float:
        ids = torch.randint(0, vocab, (1, seq), device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def fits(seq: int) -> bool:
        if any(p["seq"] == seq for p in probes):
            return next(p["fits"] for p in probes if p["seq"] == seq)
        try:
            seconds = one_step(seq)
            ok = True
        except torch.OutOfMemoryError:
            seconds, ok = None, False
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        probes.append({"seq": seq, "fits": ok, "seconds": seconds})
        print(f"  {args.arm} seq {seq}: {'fits' if ok else 'out of memory'}"
              + (f" ({seconds:.1f} s)" if seconds else ""), flush=True)
        if ok and seconds > args.probe_timeout:
            raise TimeoutError(seq)
        return ok

    step, start = args.step, max(args.step, args.start // args.step * args.step)
    longest, capped_by_time = 0, False
    try:
        if fits(start):  # double until a length fails, then bisect between the last fit and it
            low, high = start, None
            while low < args.max_tokens:
                nxt = min(low * 2, args.max_tokens)
                if not fits(nxt):
                    high = nxt
                    break
                low = nxt
            longest = low if high is None else bisect(fits, low, high - step, step)
        elif start > step:
            longest = bisect(fits, step, start - step, step)
    except TimeoutError as stop:
        longest, capped_by_time = stop.args[0], True
    tokens_per_s = None
    if longest:
        tokens_per_s = longest / one_step(longest)
        peak = torch.cuda.max_memory_allocated() / GIB
    row = {"arm": args.arm, "measured_tokens": longest, "tokens_per_s": tokens_per_s, "probes": probes,
           "stopped_by_probe_timeout": capped_by_time, "cap_gib": args.cap_gib,
           "peak_gib": peak if longest else None}
    print("RESULT " + json.dumps(row), flush=True)


def run_arm(args, arm: str, start: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--arm", arm, "--model", args.model,
           "--cap-gib", str(args.cap_gib), "--step", str(args.step), "--max-tokens", str(args.max_tokens),
           "--start", str(start), "--probe-timeout", str(args.probe_timeout), "--layers", str(args.layers)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.arm_timeout)
    except subprocess.TimeoutExpired:
        return {"arm": arm, "error": f"over {args.arm_timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("  "):
            print(line, flush=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"arm": arm, "error": ((proc.stderr.strip().splitlines() or ["no output"])[-1])[-300:]}
    return json.loads(lines[-1][len("RESULT "):])


def _plot(rows: list[dict], path: str, cap_gib: float) -> None:
    with png(path, figsize=(7, 3.5)) as ax:
        if ax is None:
            return
        arms = [r["arm"] for r in rows]
        planned = [r.get("planned_tokens") or 0 for r in rows]
        measured = [r.get("measured_tokens") or 0 for r in rows]
        ys = range(len(arms))
        ax.barh([y + 0.2 for y in ys], planned, height=0.4, label="planned", color="#9bc")
        if any(measured):
            ax.barh([y - 0.2 for y in ys], measured, height=0.4, label="measured", color="#4a7")
        ax.set_yticks(list(ys), arms)
        ax.invert_yaxis()
        ax.set_xlabel(f"longest context that trains, tokens (bs 1, {cap_gib:g} GiB cap)")
        ax.legend()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="8b")
    parser.add_argument("--arms", nargs="+", default=ARMS)
    parser.add_argument("--cap-gib", type=float, default=80.0)
    parser.add_argument("--step", type=int, default=1024, help="the context is a multiple of this")
    parser.add_argument("--max-tokens", type=int, default=512 * 1024, help="the search stops here")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (0: the shape's own count)")
    parser.add_argument("--plan", action="store_true", help="plan_memory's answer (a CPU is enough)")
    parser.add_argument("--measure", action="store_true", help="measure on the GPU, starting from the plan")
    parser.add_argument("--probe-timeout", type=float, default=60.0, help="seconds a probe step may take")
    parser.add_argument("--arm-timeout", type=float, default=400.0)
    parser.add_argument("--smoke", action="store_true", help="the tiny shape, a 0.01 GiB cap (checks the script)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "longest_context"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--arm", help=argparse.SUPPRESS)
    parser.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.smoke:
        args.model, args.cap_gib, args.step, args.max_tokens = "tiny", 0.01, 64, 64 * 1024
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        parser.error(f"--arms {', '.join(unknown)}: unknown; allowed: {', '.join(ARMS)}")
    if not (args.plan or args.measure):
        parser.error("give --plan (a CPU), --measure (a GPU), or both")
    if args.measure and not torch.cuda.is_available():
        parser.error("--measure needs a CUDA GPU; --plan runs on a CPU")
    if any("liger" in a for a in args.arms) and importlib.util.find_spec("liger_kernel") is None:
        parser.error("the Liger arms need liger-kernel (pip install liger-kernel); or leave them out with --arms")

    rows = []
    for arm in args.arms:
        row = planned_longest(args.model, arm, args.cap_gib * GIB, args.step, args.max_tokens, args.layers)
        print(f"[{arm}] planned {row['planned_tokens']:,} tokens ({row['planned_gib_at_it']:.1f} GiB)", flush=True)
        if args.measure:
            measured = run_arm(args, arm, row["planned_tokens"] or args.step)
            row.update(measured)
            if "error" in measured:
                print(f"[{arm}] failed: {measured['error']}", flush=True)
            else:
                rate = measured["tokens_per_s"]
                print(f"[{arm}] measured {measured['measured_tokens']:,} tokens"
                      + (f", {rate:,.0f} tokens/s" if rate else ""), flush=True)
        rows.append(row)
    os.makedirs(args.out, exist_ok=True)
    write_results("longest_context", rows, args.out,
                  {"command": "python bench/longest_context.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                   "model": args.model, "cap_gib": args.cap_gib, "batch": 1})
    _plot(rows, os.path.join(args.out, "longest_context.png"), args.cap_gib)
    columns = ["arm", "planned_tokens", "planned_gib_at_it"] + (["measured_tokens", "tokens_per_s"] if args.measure else [])
    print_table(rows, columns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
