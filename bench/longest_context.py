"""The longest context that trains under a memory cap: bs 1, a Llama-3 shape, per arm.

    python bench/longest_context.py --plan --out OUT                 # a CPU: plan_memory's answer, in seconds
    python bench/longest_context.py --measure --out OUT              # a GPU: measured, starting from the plan
    python bench/longest_context.py --plan --smoke --out OUT         # a CPU: the tiny shape, checks the script

The device memory is capped at ``--cap-gib`` (80 by default, so that figures compare with published 80 GB results;
``torch.cuda.set_per_process_memory_fraction`` on a GPU). The answer is the longest multiple of ``--step``
(1024) tokens at which one training step (forward, backward, fused AdamW) fits, found by bisection; with
``--measure`` each arm runs in its own process that builds the model once, probes sequence lengths from the
plan's answer outwards (an out-of-memory step is caught, the cache emptied, the next length tried) after one
warm-up step at ``--step`` tokens; tokens/s is a second step at the answer (the probe, the first step at that
length, includes compiling what specializes on it). A probe slower than ``--probe-timeout`` seconds ends the arm's
search there (attention grows with the square of the context). Arms are bench_model.py's (random bf16
weights, sdpa, LoRA r16 on the seven projections); "+gc" is gradient checkpointing (non-reentrant), "+offload"
checkpointing with the kept layer inputs in pinned host memory and the MLP in tiles (sits_lora.activations).

``--layers N`` below the shape's depth measures N layers and stands in for the rest: before each probe the cap
is lowered by what plan_memory says the missing layers hold at that length (their weights, adapters, gradients
and optimizer states, and their kept checkpoint inputs unless offloaded), so a probe fits when the full model
would (to the plan's accuracy on those parts: exact for weights, a·T·h per kept input). Steps then take N/L of
the time, which is what makes the long-context arms measurable at all (attention grows with T²).
Writes OUT/longest_context.json, .csv and .png.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_model import MODELS, build, import_unsloth, liger_patch_undone  # noqa: E402
from harness import png, print_table, run_worker, write_results  # noqa: E402

ARMS = ["frozen+liger", "sits+liger", "sits+liger+saved", "sits+liger+gc", "sits+liger+offload", "peft", "peft+gc"]
# asked for by name: a 4-bit (bitsandbytes NF4) frozen base, ours and Unsloth's QLoRA in its recommended mode
# ("+gc": its checkpoints offloaded to the host); plan_memory does not plan them, so their search starts at --step
FOUR_BIT_ARMS = ["sits+nf4+liger+offload", "sits+nf4+liger+gc", "unsloth+nf4+gc"]
GIB = 2**30


def planned(arm: str) -> bool:
    """Whether plan_memory plans the arm (not a 4-bit base built on the meta device, not Unsloth's model)."""
    return not ({"nf4"} & set(arm.split("+")) or arm.startswith("unsloth"))


def offloaded(arm: str) -> bool:
    """Whether the arm keeps its checkpointed layer inputs in host memory (ours "+offload", Unsloth's "+gc")."""
    return "offload" in arm.split("+") or (arm.startswith("unsloth") and "gc" in arm.split("+"))


def checkpointed(arm: str) -> bool:
    """Whether the arm checkpoints its layers ("+gc", or "+offload": checkpointing with the inputs on the host)."""
    return bool({"gc", "offload"} & set(arm.split("+")))


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


def planned_longest(model_name: str, arm: str, cap_bytes: float, step: int, max_tokens: int, layers: int = 0,
                    host_cap_bytes: float = float("inf")) -> dict:
    """plan_memory's longest context for ``arm`` under ``cap_bytes`` of device memory and ``host_cap_bytes`` of
    pinned host memory (a CPU, the meta device). An "+offload" arm keeps on the device the inputs of as few
    layers as the host cap requires (``keep_on_device``), the rest go to the host. An arm the plan does not cover
    (``planned``) gets a row without a plan."""
    if not planned(arm):
        return {"arm": arm, "planned_tokens": None, "planned_gib_at_it": None, "planned_host_gib_at_it": None,
                "keep_on_device": 0, "hit_search_limit": False}
    from sits_lora import plan_memory
    from sits_lora.activations import enable_offloaded_checkpointing

    with liger_patch_undone():
        model, params = build(model_name, arm, "meta", torch.bfloat16, layers)
        optimizer = "adamw" if params else "none"
        parts = set(arm.split("+"))
        gc = checkpointed(arm)
        depth = layers or MODELS[model_name]["num_hidden_layers"]

        def plan_at(seq: int):
            """(plan, layers kept on the device) at ``seq`` tokens."""
            keep = 0
            if "offload" in parts:
                per_layer = 2 * seq * MODELS[model_name]["hidden_size"]  # one bf16 layer input
                fit_on_host = depth if host_cap_bytes == float("inf") else int(host_cap_bytes // per_layer)
                keep = min(max(depth - fit_on_host, 0), depth)
                enable_offloaded_checkpointing(model, keep_on_device=keep)
            return plan_memory(model, 1, seq, gradient_checkpointing=gc, optimizer=optimizer), keep

        def fits(seq: int) -> bool:
            plan, _ = plan_at(seq)
            return plan.total <= cap_bytes and plan.host_offload <= host_cap_bytes

        longest = bisect(fits, step, max_tokens, step)
        at, keep = plan_at(longest or step)
    return {"arm": arm, "planned_tokens": longest, "planned_gib_at_it": at.total / GIB,
            "planned_host_gib_at_it": at.host_offload / GIB, "keep_on_device": keep,
            "hit_search_limit": longest >= max_tokens}


# ----------------------------------------------------------------------------- measuring (a GPU)


def missing_layers_bytes(model_name: str, arm: str, layers: int, keep_on_device: int = 0):
    """seq -> the bytes plan_memory gives the layers a ``layers``-deep build lacks (0 at full depth); with
    ``keep_on_device`` the full model keeps that many layers' inputs on the device (the shallow one none)."""
    from sits_lora import plan_memory
    from sits_lora.activations import enable_offloaded_checkpointing

    full = MODELS[model_name]["num_hidden_layers"]
    if not layers or layers >= full:
        return lambda seq: 0
    with liger_patch_undone():
        deep, deep_params = build(model_name, arm, "meta", torch.bfloat16, full)
        shallow, _ = build(model_name, arm, "meta", torch.bfloat16, layers)
        if keep_on_device:
            enable_offloaded_checkpointing(deep, keep_on_device=keep_on_device)
    optimizer = "adamw" if deep_params else "none"
    gc = checkpointed(arm)

    def missing(seq: int) -> int:
        plans = [plan_memory(m, 1, seq, gradient_checkpointing=gc, optimizer=optimizer) for m in (deep, shallow)]
        return plans[0].total - plans[1].total

    return missing


def measured_missing_bytes(model, arm: str, model_name: str, layers: int):
    """seq -> what the layers a ``layers``-deep build lacks would hold on the device, read off the built model
    instead of planned (for the arms plan_memory does not cover, ours and Unsloth's alike): each missing layer
    as the first decoder layer holds its parameters (4-bit ones packed), plus a gradient and two AdamW states for
    each trainable one, plus its kept input (seq x hidden, bf16) unless the arm offloads it to the host."""
    full = MODELS[model_name]["num_hidden_layers"]
    if not layers or layers >= full:
        return lambda seq: 0
    first = next(m for name, m in model.named_modules()
                 if name.endswith("layers") and isinstance(m, torch.nn.ModuleList))[0]
    from sits_lora.utils.model_structure import stored_bytes   # a 4-bit weight's quantization state included

    held = sum(stored_bytes(t) for t in list(first.parameters()) + list(first.buffers()))
    trainable = sum(p.numel() * p.element_size() for p in first.parameters() if p.requires_grad)
    per_layer = held + 3 * trainable
    kept = 0 if offloaded(arm) else 2 * MODELS[model_name]["hidden_size"]

    return lambda seq: (full - layers) * (per_layer + kept * seq)


def worker(args) -> None:
    """One arm: build once, probe from the planned length outwards, print RESULT json."""
    if args.arm.startswith("unsloth"):
        import_unsloth(args.arm, "cuda")
    total = torch.cuda.get_device_properties(0).total_memory
    missing = missing_layers_bytes(args.model, args.arm, args.layers, args.keep_on_device) if planned(args.arm) \
        else (lambda seq: 0)

    def cap_for(seq: int) -> None:
        torch.cuda.set_per_process_memory_fraction(max(min((args.cap_gib * GIB - missing(seq)) / total, 1.0), 0.01))

    cap_for(args.step)
    model, params = build(args.model, args.arm, "cuda", torch.bfloat16, args.layers, args.max_tokens)
    if not planned(args.arm):
        missing = measured_missing_bytes(model, args.arm, args.model, args.layers)
    if args.keep_on_device and not (args.layers and args.layers < MODELS[args.model]["num_hidden_layers"]):
        from sits_lora.activations import enable_offloaded_checkpointing

        enable_offloaded_checkpointing(model, keep_on_device=args.keep_on_device)
    model.train()
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True) if params else None
    vocab = MODELS[args.model]["vocab_size"]
    probes = []

    def one_step(seq: int) -> float:
        cap_for(seq)
        ids = torch.randint(0, vocab, (1, seq), device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
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
        probes.append({"seq": seq, "fits": ok, "seconds": seconds,
                       "peak_gib": torch.cuda.max_memory_allocated() / GIB if ok else None})
        print(f"  {args.arm} seq {seq}: {'fits' if ok else 'out of memory'}"
              + (f" ({seconds:.1f} s)" if seconds else ""), flush=True)
        if ok and seconds > args.probe_timeout:
            raise TimeoutError(seq)
        return ok

    one_step(args.step)  # kernels compiled and tuned at a short length, so that each probe times a warm step
    model.zero_grad(set_to_none=True)
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
        # timed again: a probe is the first step at its length, which includes compiling the kernels that
        # specialize on it (a second or two: at 20k tokens that was three quarters of sits' step)
        first_seconds = next((p["seconds"] for p in probes if p["seq"] == longest and p["fits"]), None)
        model.zero_grad(set_to_none=True)
        try:
            seconds = one_step(longest)
        except torch.OutOfMemoryError:  # fragmented by the probes after it: the probe's time, flagged
            seconds, first_seconds = first_seconds, None
            torch.cuda.empty_cache()
        # tokens/s of the full depth: the N measured layers stand for L (the head and loss counted L/N times: a
        # small overestimate of the time)
        full = MODELS[args.model]["num_hidden_layers"]
        depth = args.layers if args.layers and args.layers < full else full
        tokens_per_s = longest / (seconds * full / depth)
        peak = next((p["peak_gib"] for p in probes if p["seq"] == longest and p["fits"]), None) or \
            torch.cuda.max_memory_allocated() / GIB
        host = getattr(torch.cuda, "host_memory_stats", lambda: {})()
        host_peak = host.get("allocated_bytes.all.peak", host.get("allocated_bytes.peak"))
    row = {"arm": args.arm, "measured_tokens": longest, "tokens_per_s": tokens_per_s,
           "step_s": seconds if longest else None, "first_step_s": first_seconds if longest else None,
           "probes": probes,
           "stopped_by_probe_timeout": capped_by_time, "cap_gib": args.cap_gib,
           "layers_measured": args.layers or MODELS[args.model]["num_hidden_layers"],
           "peak_gib": peak if longest else None,
           # what the full depth would hold: the measured peak plus the plan's missing layers
           "full_depth_peak_gib": (peak + missing(longest) / GIB) if longest else None,
           "pinned_host_peak_gib": host_peak / GIB if longest and host_peak else None}
    print("RESULT " + json.dumps(row), flush=True)


def run_arm(args, arm: str, start: int, keep_on_device: int = 0) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--arm", arm, "--model", args.model,
           "--keep-on-device", str(keep_on_device),
           "--cap-gib", str(args.cap_gib), "--step", str(args.step), "--max-tokens", str(args.max_tokens),
           "--start", str(start), "--probe-timeout", str(args.probe_timeout), "--layers", str(args.layers)]
    return run_worker(cmd, args.arm_timeout, {"arm": arm}, echo=lambda line: line.startswith("  "))


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
    parser.add_argument("--host-cap-gib", type=float, default=100.0,
                        help="pinned host memory the offloaded checkpoints may take (the H200 machine has 128 GiB)")
    parser.add_argument("--step", type=int, default=1024, help="the context is a multiple of this")
    parser.add_argument("--max-tokens", type=int, default=1024 * 1024, help="the search stops here")
    parser.add_argument("--layers", type=int, default=0,
                        help="decoder layers to measure, standing in for the shape's own count (0: all of them)")
    parser.add_argument("--plan", action="store_true", help="plan_memory's answer (a CPU is enough)")
    parser.add_argument("--measure", action="store_true", help="measure on the GPU, starting from the plan")
    parser.add_argument("--probe-timeout", type=float, default=60.0, help="seconds a probe step may take")
    parser.add_argument("--arm-timeout", type=float, default=400.0)
    parser.add_argument("--smoke", action="store_true", help="the tiny shape, a 0.01 GiB cap (checks the script)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "longest_context"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--arm", help=argparse.SUPPRESS)
    parser.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--keep-on-device", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.smoke:
        args.model, args.cap_gib, args.step, args.max_tokens = "tiny", 0.01, 64, 64 * 1024
    unknown = [a for a in args.arms if a not in ARMS + FOUR_BIT_ARMS]
    if unknown:
        parser.error(f"--arms {', '.join(unknown)}: unknown; allowed: {', '.join(ARMS + FOUR_BIT_ARMS)}")
    unplanned = [a for a in args.arms if not planned(a)]
    if unplanned and args.plan and not args.measure:
        parser.error(f"--arms {', '.join(unplanned)}: plan_memory does not plan a 4-bit base built on the meta device "
                     "or Unsloth's model; measure them (--measure, a GPU)")
    if args.layers and any(not planned(a) and not checkpointed(a) for a in args.arms):
        parser.error("--layers: the 4-bit and Unsloth arms stand in for the missing layers by what the built layers "
                     "hold, which needs checkpointing (+gc / +offload); give --layers 0 or a checkpointed arm")
    if not (args.plan or args.measure):
        parser.error("give --plan (a CPU), --measure (a GPU), or both")
    if args.measure and not torch.cuda.is_available():
        parser.error("--measure needs a CUDA GPU; --plan runs on a CPU")
    if any("liger" in a for a in args.arms) and importlib.util.find_spec("liger_kernel") is None:
        parser.error("the Liger arms need liger-kernel (pip install liger-kernel); or leave them out with --arms")

    rows = []
    for arm in args.arms:
        # the plan is the full model's (--layers only makes the measurement shallower)
        row = planned_longest(args.model, arm, args.cap_gib * GIB, args.step, args.max_tokens, 0,
                              args.host_cap_gib * GIB)
        if row["planned_tokens"] is None:
            print(f"[{arm}] not planned (plan_memory does not cover it): the search starts at {args.step} tokens",
                  flush=True)
        else:
            print(f"[{arm}] planned {row['planned_tokens']:,} tokens ({row['planned_gib_at_it']:.1f} GiB)", flush=True)
        if args.measure:
            measured = run_arm(args, arm, row["planned_tokens"] or args.step, row["keep_on_device"])
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
    columns = ["arm", "planned_tokens", "planned_gib_at_it", "planned_host_gib_at_it", "keep_on_device"] + (["measured_tokens", "tokens_per_s"] if args.measure else [])
    print_table(rows, columns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
