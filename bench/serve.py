"""Decoding with adapters: time per generated token for the base model, one adapter merged, one adapter unmerged
(PEFT, sits_lora) and a batch whose samples take 8 different adapters (PEFT's mixed batch, sits_lora's segmented
kernels), side by side in one run.

    python bench/serve.py --out OUT                                  # GPU: the 1B shape, batch 1, 8, 32, 128 tokens
    python bench/serve.py --out OUT --shapes 8b --layers 4           # the 8B shape at 4 decoder layers
    python bench/serve.py --out OUT --smoke                          # tiny config on a CPU (checks the script)

Random bf16 weights in Llama-3 shapes (bench_model.MODELS), LoRA r16 alpha 32 on the seven projections, 8 adapters
with random A and B; prompts of --prompt random tokens; greedy ``generate`` (eager, transformers' dynamic cache) of
--new-tokens tokens. Time per token = (time of --new-tokens tokens - time of 1 token) / (--new-tokens - 1): the
decode steps without the prefill. Arms, each on the same prompts:
  base         the adapters disabled
  merged       adapter 0 merged into the weights (the time any unmerged arm is held to)
  peft         PEFT's LoRA, adapter 0 active, unmerged
  sits         sits_lora, adapter 0 active, unmerged
  peft+mixed8  PEFT, sample i takes adapter i mod 8 (``adapter_names``: PEFT's loop over adapters)
  sits+mixed8  sits_lora, the same names (one segmented shrink and expand per layer)
  sits+pooled  sits_lora with the 8 adapters in host memory and 2 GPU slots (sits_lora.AdapterPool): each
               generate call is a request for the next of adapters 0 and 1 in turn, all samples on it (both stay
               resident: no copy)
  sits+stream  the same pool, requests for all 8 adapters in turn: each request's adapter was prefetched (side
               stream) while the one before it decoded. request_ms against sits+pooled's is what streaming costs
  X+graph      arm X with its decode steps replayed as CUDA graphs (sits_lora.graph_decode, installed on every
               model; off for the other arms) into one transformers StaticCache per model and batch, reset between
               requests (what a server does); columns graph_replays / graph_recordings count what it did
The graph arms also report gpu_step_ms: the median GPU time of one replayed decode step (CUDA events around each
replay of the n-token request), free of the host's time between steps, and gpu_vs_merged against merged+graph's.
The pool arms also report stall_ms_per_request (how long the GPU waited for adapter copies, AdapterPool's CUDA
events) and copy_ms_predicted (one adapter's bytes over the measured pinned bandwidth: the stall of a swap that was
not prefetched).
Every arm runs --repeats rounds after a warm-up round, arms in turn; the median round. vs_merged: against merged, a
graph arm against merged+graph when that ran. Writes OUT/serve.json, .csv
and serve.png. --plan adds serving_plan's measured costs and merge crossover per batch (OUT/serve_plan.json, .csv).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_model import MODELS, TARGETS  # noqa: E402
from harness import png, print_table, write_results  # noqa: E402

ARMS = ["base", "merged", "peft", "sits", "peft+mixed8", "sits+mixed8", "sits+pooled", "sits+stream"]
ALL_ARMS = ARMS + [f"{arm}+graph" for arm in ARMS]
ADAPTERS = [f"adapter{i}" for i in range(8)]
# the pool arms: the adapters their requests take in turn (2 slots: sits+pooled's two stay resident, sits+stream's
# eight do not)
STREAM_ARMS = {"sits+pooled": ADAPTERS[:2], "sits+stream": ADAPTERS}


def build(shape: str, layers: int | None, device: str, dtype):
    """(sits model, PEFT model): one random base in the shape, each wrapper over its own copy, 8 adapters each with
    the same weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from sits_lora import SitsLoraConfig

    config = LlamaConfig(**{**MODELS[shape], **({"num_hidden_layers": layers} if layers else {})})
    torch.manual_seed(0)
    with torch.device(device):
        base = LlamaForCausalLM(config).to(dtype).eval()
    models = []
    for config_cls in (SitsLoraConfig, LoraConfig):
        model = None
        for name in ADAPTERS:
            lora = config_cls(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS)
            if model is None:
                model = get_peft_model(base if config_cls is LoraConfig else copy.deepcopy(base), lora,
                                       adapter_name=name)
            else:
                model.add_adapter(name, lora)
        models.append(model.eval())
    gen = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        peft_params = dict(models[1].named_parameters())
        for n, p in models[0].named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype) * 0.02)
                peft_params[n].copy_(p)
    return models


def build_pool(sits, shape: str, layers: int | None, device: str, dtype):
    """A third copy of the base with sits_lora's default adapter and an AdapterPool of 2 slots holding the 8
    adapters of ``sits`` in host memory."""
    from peft import get_peft_model
    from peft.utils import get_peft_model_state_dict
    from transformers import LlamaConfig, LlamaForCausalLM

    from sits_lora import AdapterPool, SitsLoraConfig

    config = LlamaConfig(**{**MODELS[shape], **({"num_hidden_layers": layers} if layers else {})})
    with torch.device(device):
        base = LlamaForCausalLM(config).to(dtype).eval()
    host = get_peft_model(base, SitsLoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS)).eval()
    pool = AdapterPool(host, capacity=2, max_rank=16)
    for name in ADAPTERS:
        state = {k: v.cpu() for k, v in get_peft_model_state_dict(sits, adapter_name=name).items()}
        pool.add(name, state, config=sits.peft_config[name])
    return host, pool


def static_cache(model, batch: int, length: int, caches: dict):
    """(keyword, cache): one transformers StaticCache per model and batch, reset for each request (its keyword is
    ``cache`` in newer transformers, ``past_key_values`` in older)."""
    import inspect

    from transformers import StaticCache

    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    key = (id(model), batch)
    if key not in caches:
        caches[key] = StaticCache(config=lm.config, max_cache_len=length)
    keyword = "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"
    caches[key].reset()
    return keyword, caches[key]


class ReplayTimer:
    """GPU milliseconds of each CUDA-graph replay while ``active``: an event before and after every replay (of any
    graph: graph_decode's decode steps here), read after the request synchronized. ``install`` wraps the replay
    method of ``graph_class``; ``uninstall`` puts it back."""

    def __init__(self, graph_class=None, event=None) -> None:
        self.graph_class = graph_class if graph_class is not None else torch.cuda.CUDAGraph
        self.event = event if event is not None else (lambda: torch.cuda.Event(enable_timing=True))
        self.active, self._pairs, self._original = False, [], None

    def install(self) -> "ReplayTimer":
        original, timer = self.graph_class.replay, self

        def replay(graph, *args, **kwargs):
            if not timer.active:
                return original(graph, *args, **kwargs)
            before, after = timer.event(), timer.event()
            before.record()
            result = original(graph, *args, **kwargs)
            after.record()
            timer._pairs.append((before, after))
            return result

        self._original, self.graph_class.replay = original, replay
        return self

    def uninstall(self) -> None:
        if self._original is not None:
            self.graph_class.replay, self._original = self._original, None

    @contextlib.contextmanager
    def paused(self):
        """No replay is timed inside (a profiled request's replays are not the timed request's)."""
        active, self.active = self.active, False
        try:
            yield
        finally:
            self.active = active

    def take_ms(self) -> list:
        """The replays' times since the last call, in order (the caller has synchronized)."""
        times = [before.elapsed_time(after) for before, after in self._pairs]
        self._pairs.clear()
        return times


def generate_seconds(model, ids, new_tokens: int, adapter_names, device: str, cache=None) -> float:
    kwargs = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    if adapter_names is not None:
        kwargs["adapter_names"] = adapter_names
    if cache is not None:
        kwargs[cache[0]] = cache[1]
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, **kwargs)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def kernel_events(fn) -> list:
    """(name, µs) of every CUDA kernel (and copy) ``fn()`` ran, from torch.profiler (kernels replayed from CUDA graphs
    included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.elapsed_us()) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def per_step_kernels(long: list, short: list, steps: int) -> list:
    """[(kernel, calls a step, µs a step)], longest first: the kernels of a long request less those of a short one
    (the same prompt: the prefill and the first token cancel), over the long one's ``steps`` extra decode steps."""
    totals: dict = {}
    for sign, events in ((1, long), (-1, short)):
        for name, us in events:
            calls, total = totals.get(name, (0, 0.0))
            totals[name] = (calls + sign, total + sign * us)
    rows = [(name, calls / steps, total / steps) for name, (calls, total) in totals.items() if calls > 0]
    return sorted(rows, key=lambda row: -row[2])


def timed_arm(model, arm: str, ids, new_tokens: int, device: str, pool=None, turn=None,
              caches: dict | None = None, kernels: list | None = None, timer=None) -> tuple[float, float]:
    """(seconds per decoded token, seconds of the request of ``new_tokens`` tokens) of ``arm`` on ``model`` (set up
    and undone here). A pool arm: each of the two requests takes the next adapter of ``turn`` (an iterator over
    STREAM_ARMS[arm]) and prefetches the one after it. A graph arm decodes into a static cache of ``caches``.
    ``kernels``: a list that gets the arm's kernels per decode step (per_step_kernels), profiled after the timing
    with ``timer`` (a ReplayTimer) off."""
    graphed = arm.endswith("+graph")
    arm = arm.removesuffix("+graph")
    length = ids.shape[1] + new_tokens
    cache = (lambda: static_cache(model, ids.shape[0], length, caches)) if graphed else (lambda: None)
    names = [ADAPTERS[i % len(ADAPTERS)] for i in range(ids.shape[0])] if arm.endswith("mixed8") else None
    if arm not in STREAM_ARMS:
        model.set_adapter(ADAPTERS[0])
    if arm == "merged":
        model.merge_adapter([ADAPTERS[0]])

    def run(n):
        if arm == "base":
            with model.disable_adapter():
                return generate_seconds(model, ids, n, None, device, cache())
        if arm in STREAM_ARMS:
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            name, order = next(turn), STREAM_ARMS[arm]
            slots = pool.slots_for([name] * ids.shape[0])   # a copy unless the last request prefetched it
            pool.prefetch(order[(order.index(name) + 1) % len(order)])
            return time.perf_counter() - start + generate_seconds(model, ids, n, slots, device, cache())
        return generate_seconds(model, ids, n, names, device, cache())

    try:
        request = run(new_tokens)
        seconds = (request - run(1)) / (new_tokens - 1)
        if kernels is not None:
            with timer.paused() if timer is not None else contextlib.nullcontext():
                kernels.extend(per_step_kernels(kernel_events(lambda: run(new_tokens)), kernel_events(lambda: run(1)),
                                                new_tokens - 1))
        return seconds, request
    finally:
        if arm == "merged":
            model.unmerge_adapter()


def plan_costs(model, shape: str, batches, device: str) -> list:
    """serving_plan's measured costs for adapter 0 at each batch size, and the new tokens from which merging pays."""
    from sits_lora.serving import measure_serving_costs

    rows = []
    for batch in batches:
        costs = measure_serving_costs(model, ADAPTERS[0], batch_size=batch, graphs=device == "cuda", repeats=20)
        crossover = costs.crossover_tokens
        rows.append({"shape": shape, "batch": batch, "graphs": device == "cuda", "dispatch_ms": costs.dispatch_ms,
                     "merged_ms": costs.merged_ms, "merge_ms": costs.merge_ms,
                     "crossover_tokens": None if crossover == float("inf") else crossover})
        print(f"[{shape} bs{batch}] serving_plan costs: step {costs.dispatch_ms:.3f} ms unmerged, "
              f"{costs.merged_ms:.3f} merged, merge + unmerge {costs.merge_ms:.2f}; merging pays after "
              f"{crossover:.0f} tokens", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", nargs="+", choices=["1b", "8b"], default=["1b"])
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's all)")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--arms", nargs="+", choices=ALL_ARMS, default=ARMS)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny config on any device (checks the script)")
    parser.add_argument("--profile", action="store_true",
                        help="after the last round, profile each arm (but the pool arms) once: its CUDA kernels per "
                             "decode step, OUT/serve_kernels.json and .csv")
    parser.add_argument("--plan", action="store_true",
                        help="also measure serving_plan's costs per shape and batch (sits_lora.measure_serving_costs "
                             "of adapter 0: a decode-sized forward unmerged and merged, as replayed CUDA graphs on a "
                             "GPU, and one merge + unmerge) and the crossover: OUT/serve_plan.json and .csv")
    args = parser.parse_args(argv)
    for flag in ("prompt", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.new_tokens < 2:
        parser.error(f"--new-tokens must be >= 2 (the time per token is a difference), got {args.new_tokens}")
    if any(b < 1 for b in args.batches):
        parser.error(f"--batches must be >= 1, got {args.batches}")
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers must be >= 1, got {args.layers}")
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu" and not args.smoke:
        parser.error("the 1B / 8B shapes need a CUDA GPU; --smoke runs a tiny config on a CPU")
    if device == "cpu" and args.profile:
        parser.error("--profile lists CUDA kernels: it needs a CUDA GPU")
    if device == "cpu" and any(a.endswith("+graph") for a in args.arms):
        parser.error("the +graph arms record CUDA graphs: they need a CUDA GPU (drop them from --arms on a CPU)")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = ["tiny"] if args.smoke else args.shapes
    new_tokens, repeats = (3, 1) if args.smoke else (args.new_tokens, args.repeats)
    rows, kernel_rows, plan_rows = [], [], []
    for shape in shapes:
        sits, peft_model = build(shape, args.layers, device, dtype)
        streamed = [a for a in args.arms if a.removesuffix("+graph") in STREAM_ARMS]
        pooled, pool = build_pool(sits, shape, args.layers, device, dtype) if streamed else (None, None)
        turns = {arm: itertools.cycle(STREAM_ARMS[arm.removesuffix("+graph")]) for arm in streamed}
        graphs, caches = {}, {}
        if any(a.endswith("+graph") for a in args.arms):
            from sits_lora import graph_decode

            # one recorder per model, replaying only for the graph arms; each (arm, batch) records its own step
            graphs = {id(m): graph_decode(m, max_graphs=4 * len(args.arms) * len(args.batches))
                      for m in (sits, peft_model, pooled) if m is not None}
            timer = ReplayTimer().install()
        else:
            timer = None
        for batch in args.batches:
            gen = torch.Generator().manual_seed(2)
            ids = torch.randint(3, MODELS[shape]["vocab_size"], (batch, args.prompt), generator=gen).to(device)
            times = {arm: [] for arm in args.arms}
            requests = {arm: [] for arm in args.arms}
            counts = {arm: [0, 0] for arm in args.arms}      # graph replays, recordings in the timed rounds
            stalls = {arm: 0.0 for arm in args.arms}         # ms the GPU waited for adapter copies, timed rounds
            gpu_steps = {arm: [] for arm in args.arms}       # GPU ms of each replayed decode step, timed rounds
            for round_ in range(repeats + 1):     # round 0 warms up (autotuning, allocator, the mixed-batch plans)
                for arm in args.arms:
                    kind = arm.removesuffix("+graph")
                    model = peft_model if arm.startswith("peft") else pooled if kind in STREAM_ARMS else sits
                    for recorder in graphs.values():
                        recorder.active = arm.endswith("+graph")
                    before = {k: (g.replays, g.recordings) for k, g in graphs.items()}
                    stall_before = pool.measured_stall_ms() if kind in STREAM_ARMS else 0.0
                    if timer is not None:
                        timer.active = arm.endswith("+graph")
                    kernels = [] if args.profile and round_ == repeats and kind not in STREAM_ARMS else None
                    seconds, request = timed_arm(model, arm, ids, new_tokens, device, pool, turns.get(arm), caches,
                                                 kernels, timer)
                    steps = timer.take_ms() if timer is not None else []
                    if kernels:
                        kernel_rows += [{"shape": shape, "batch": batch, "arm": arm, "kernel": name,
                                         "calls_per_step": calls, "us_per_step": us} for name, calls, us in kernels]
                        print(f"[{shape} bs{batch} {arm}] kernels a decode step: {sum(k[2] for k in kernels):.1f} µs",
                              *(f"    {us:8.1f} µs  {calls:6.2f} x  {name[:100]}" for name, calls, us in kernels[:12]),
                              sep="\n", flush=True)
                    if round_:
                        times[arm].append(seconds)
                        gpu_steps[arm].extend(steps)
                        requests[arm].append(request)
                        if kind in STREAM_ARMS:
                            stalls[arm] += pool.measured_stall_ms() - stall_before
                        if id(model) in graphs:
                            g = graphs[id(model)]
                            counts[arm][0] += g.replays - before[id(model)][0]
                            counts[arm][1] += g.recordings - before[id(model)][1]
            for arm in args.arms:
                held_to = "merged+graph" if arm.endswith("+graph") and "merged+graph" in times else "merged"
                merged = statistics.median(times[held_to]) if held_to in times else None
                seconds = statistics.median(times[arm])
                gpu_step = statistics.median(gpu_steps[arm]) if gpu_steps[arm] else None
                merged_step = statistics.median(gpu_steps["merged+graph"]) if gpu_steps.get("merged+graph") else None
                rows.append({"shape": shape, "layers": args.layers, "batch": batch, "arm": arm,
                             "ms_per_token": seconds * 1000, "tokens_per_s": batch / seconds,
                             "request_ms": statistics.median(requests[arm]) * 1000,
                             "vs_merged": seconds / merged if merged else None,
                             "gpu_step_ms": gpu_step,
                             "gpu_vs_merged": gpu_step / merged_step if gpu_step and merged_step else None,
                             "rounds_ms": [t * 1000 for t in times[arm]], "prompt": args.prompt,
                             "new_tokens": new_tokens, "graph_replays": counts[arm][0] if graphs else None,
                             "graph_recordings": counts[arm][1] if graphs else None,
                             # two requests per round (new_tokens, then 1 token)
                             "stall_ms_per_request": stalls[arm] / (2 * repeats)
                             if arm.removesuffix("+graph") in STREAM_ARMS else None,
                             "copy_ms_predicted": pool.predicted_stall_ms(ADAPTERS[0])
                             if arm.removesuffix("+graph") in STREAM_ARMS and device == "cuda" else None})
                print(f"[{shape} bs{batch} {arm}] {seconds * 1000:.2f} ms per token"
                      + (f", GPU {gpu_step:.3f} ms a replayed step" if gpu_step else ""), flush=True)
        if pool is not None:
            for r in rows:
                if r["shape"] == shape and r["arm"].removesuffix("+graph") in STREAM_ARMS:
                    r["pool_stats"] = dict(pool.stats)   # both pool arms together
        for recorder in graphs.values():
            recorder.release()
        if timer is not None:
            timer.uninstall()
        if args.plan:
            plan_rows += plan_costs(sits, shape, args.batches, device)
        del sits, peft_model, pooled, pool, graphs, caches
        if device == "cuda":
            torch.cuda.empty_cache()
    for shape in shapes:
        for batch in args.batches:
            ms = {r["arm"]: r["ms_per_token"] for r in rows if (r["shape"], r["batch"]) == (shape, batch)}
            peft_mixed = min((ms[a] for a in ("peft+mixed8", "peft+mixed8+graph") if a in ms), default=None)
            for r in rows:
                if (r["shape"], r["batch"]) == (shape, batch):   # against PEFT's faster mixed batch
                    r["peft_mixed8_over_this"] = peft_mixed / r["ms_per_token"] if peft_mixed else None
    command = "python bench/serve.py " + " ".join(argv if argv is not None else sys.argv[1:])
    paths = write_results("serve", rows, args.out, {"command": command})
    if args.profile:
        paths += write_results("serve_kernels", kernel_rows, args.out, {"command": command})
    if args.plan:
        paths += write_results("serve_plan", plan_rows, args.out, {"command": command})
        print_table(plan_rows, ["shape", "batch", "dispatch_ms", "merged_ms", "merge_ms", "crossover_tokens"])
    print_table(rows, ["shape", "batch", "arm", "ms_per_token", "tokens_per_s", "request_ms", "vs_merged",
                       "gpu_step_ms", "gpu_vs_merged", "peft_mixed8_over_this"])
    with png(os.path.join(args.out, "serve.png"), figsize=(7, 3.5)) as ax:
        if ax is not None:
            groups = sorted({(r["shape"], r["batch"]) for r in rows})
            width = 0.8 / len(groups)
            for i, (shape, batch) in enumerate(groups):
                values = [next((r["ms_per_token"] for r in rows if (r["shape"], r["batch"], r["arm"]) ==
                                (shape, batch, arm)), 0) for arm in args.arms]
                ax.bar([j + i * width for j in range(len(args.arms))], values, width=width, label=f"{shape} bs{batch}")
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(args.arms))], args.arms, fontsize=7, rotation=20,
                          ha="right")
            ax.set_ylabel("ms per token")
            ax.legend(fontsize=7)
    print("wrote", *paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
