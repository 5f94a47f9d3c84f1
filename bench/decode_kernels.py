"""The decode path's kernel against the merged model's GEMM, per projection shape and row count, in GPU time.

    python bench/decode_kernels.py --out OUT [--shapes 1b 8b] [--rows 1 8 32 64] [--rank 16] [--adapter-dtype fp32]
                                          [--projections ...] [--warm-l2] [--cache PATH]

For each Llama-3 projection shape (K -> N) of --shapes, and each sibling group the decode path runs as one kernel
(q+k+v, gate+up: K -> the N of each), LoRA r16 (--rank), bf16 activations and weights with fp32 adapters (PEFT's
default over a bf16 base; --adapter-dtype bf16 for adapters cast to the base's dtype), and each row count (the
batch of a decode step), times one call of:
  merged    F.linear(x, W): the merged model's projection (the floor); for a group, its GEMMs one after another
  aten      sits_lora.ops.lora_linear_aten without gradients: the small-call path (3 matmuls)
  default   sits_lora.ops.lora_linear_decode at the first configuration of ops.tuning's "decode" space
  tuned     the same at the fastest configuration of that space, measured here
  unsplit   the fastest configuration that does not split K (SPLIT_K 1): tuned against it is what the split gains
  gemv      at one row: the fastest configuration of the one-row kernel (ops.tuning's "decode_gemv" space); stored
            in the cache only where it beats tuned, the only place the decode path then runs it
Each time is the GPU's: 20 calls (or one per copy of W, below) recorded as one CUDA graph, replayed --replays times
between CUDA events, the median replay / calls (launch costs left out, as under sits_lora.graph_decode). The calls
cycle through copies of W (column w_copies) that together fill twice the L2, so that every call reads W from memory
as a model's decode step does (each layer's W once); --warm-l2 times every call on one W (earlier runs did). The
fastest configurations are written in the tuning cache format to --cache (default OUT/decode_configs.json): run
later scripts with SITS_LORA_TUNING_CACHE=that file to use them, or merge them into
src/sits_lora/ops/tuned_configs.json.
Writes OUT/decode_kernels.json, .csv and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_model import MODELS  # noqa: E402
from harness import png, print_table, write_results  # noqa: E402

CALLS = 20


def projection_shapes(shape: str) -> dict[str, tuple[int, tuple]]:
    """name -> (K, the N of each projection one call computes): the single projections, and the sibling groups
    that the decode path runs as one kernel (q+k+v, gate+up)."""
    c = MODELS[shape]
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    kv = hidden // c["num_attention_heads"] * c["num_key_value_heads"]
    return {"q/o": (hidden, (hidden,)), "k/v": (hidden, (kv,)), "gate/up": (hidden, (inter,)),
            "down": (inter, (hidden,)), "q+k+v": (hidden, (hidden, kv, kv)), "gate+up": (hidden, (inter, inter))}


PROJECTIONS = ("q/o", "k/v", "gate/up", "down", "q+k+v", "gate+up")


def copies_for_cold_l2(nbytes: int, l2_bytes: int, most: int = 64) -> int:
    """How many copies of a weight of ``nbytes`` the timed calls cycle through so that a copy is evicted from an L2
    of ``l2_bytes`` before it is read again (the other copies in between fill twice the L2), as in a model's decode
    step, where each layer's weight is read once; at most ``most``."""
    return max(1, min(most, -(-2 * l2_bytes // max(1, nbytes)) + 1))


def graph_us(fn, replays: int, calls: int = CALLS) -> float:
    """GPU microseconds of one fn(i) call: ``calls`` calls (i = 0 .. calls - 1) recorded as one graph, the median of
    ``replays`` replays."""
    for i in range(2):
        fn(i)                                      # compile and autotune off the recording
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def timed_configs(configs: list, time_us, label: str) -> list:
    """(µs, configuration) of each configuration ``time_us`` could run; one this GPU cannot run (too much shared
    memory) is skipped and named."""
    timings = []
    for cfg in configs:
        try:
            timings.append((time_us(cfg), cfg))
        except Exception as error:   # noqa: BLE001 (the launch's own error, printed)
            print(f"  skipped {label}{cfg}: {type(error).__name__}: {str(error)[:200]}", flush=True)
            torch.cuda.synchronize()
    return timings


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", nargs="+", choices=["1b", "8b"], default=["1b", "8b"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32, 64])
    parser.add_argument("--projections", nargs="+", choices=PROJECTIONS, default=list(PROJECTIONS),
                        help="single projections and sibling groups (q+k+v, gate+up: one kernel for the group, "
                             "merged = the group's GEMMs one after another)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--warm-l2", action="store_true",
                        help="time every call on the same W (by default the calls cycle through copies of W that "
                             "do not fit in L2 together, as a model's layers do)")
    parser.add_argument("--adapter-dtype", choices=["fp32", "bf16"], default="fp32",
                        help="the adapters' dtype (fp32: PEFT's default over a bf16 base)")
    parser.add_argument("--cache", default=None, help="tuning cache to write (default OUT/decode_configs.json)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("this benchmark times CUDA graphs: it needs a CUDA GPU")
    if any(not 1 <= r <= 64 for r in args.rows):
        parser.error(f"--rows must be within 1..64 (the decode kernel's limit), got {args.rows}")
    if args.rank < 1 or args.replays < 1:
        parser.error("--rank and --replays must be >= 1")
    from sits_lora import ops
    from sits_lora.ops.decode import rows_block
    from sits_lora.ops.geometry import block_rank
    from sits_lora.ops.tuning import CONFIG_SPACE, config_key

    device = torch.device("cuda")
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    adapter_dtype = torch.float32 if args.adapter_dtype == "fp32" else torch.bfloat16
    space = CONFIG_SPACE["decode"]
    cache_path = args.cache or os.path.join(args.out, "decode_configs.json")
    best_configs: dict = {}
    rows_out = []
    gen = torch.Generator(device=device).manual_seed(0)
    for shape in args.shapes:
        for name, (K, widths) in projection_shapes(shape).items():
            if name not in args.projections:
                continue
            N = sum(widths)
            group = len(widths) > 1
            Ws = [torch.randn(n, K, device=device, dtype=torch.bfloat16, generator=gen) / K**0.5 for n in widths]
            # a model reads each layer's W once a step: copies cycled through so that W is not in L2 when read
            # (the 1B shapes' 8-32 MB would stay in the H200's 50 MB L2 across 20 calls of one W)
            n_copies = 1 if args.warm_l2 else copies_for_cold_l2(sum(W.nbytes for W in Ws), l2_bytes)
            copies = [[W] + [W.clone() for _ in range(n_copies - 1)] for W in Ws]
            calls = max(CALLS, n_copies)        # every copy read once a replay
            As = [(torch.randn(args.rank, K, device=device, generator=gen) / K**0.5).to(adapter_dtype) for _ in widths]
            Bs = [(torch.randn(n, args.rank, device=device, generator=gen) * 0.01).to(adapter_dtype) for n in widths]

            def siblings(i):
                return [(c[i % n_copies], None, A, B, 2.0) for c, A, B in zip(copies, As, Bs)]

            for rows in args.rows:
                x = torch.randn(rows, K, device=device, dtype=torch.bfloat16, generator=gen)
                with torch.no_grad():
                    merged = graph_us(lambda i: [F.linear(x, W) for W, *_ in siblings(i)], args.replays, calls)
                    aten = graph_us(lambda i: [ops.lora_linear_aten(x, x, W, None, A, B, s)
                                               for W, _, A, B, s in siblings(i)], args.replays, calls)

                    def decode_us(cfg: dict) -> float:
                        if group:
                            return graph_us(lambda i: ops.lora_linear_decode_siblings(x, siblings(i), config=cfg),
                                            args.replays, calls)
                        return graph_us(lambda i: ops.lora_linear_decode(x, *siblings(i)[0], config=cfg),
                                        args.replays, calls)

                    timings = timed_configs(space, decode_us, "")
                    gemv_timings = timed_configs(CONFIG_SPACE["decode_gemv"] if rows == 1 and not group else [],
                                                 lambda cfg: decode_us(dict(cfg, GEMV=True)), "one-row ")
                if not timings:
                    raise SystemExit(f"no decode configuration ran at {K}->{N}, {rows} rows (see the skips above)")
                default = next((us for us, cfg in timings if cfg is space[0]), None)
                tuned, best = min(timings, key=lambda t: t[0])
                gemv, gemv_best = min(gemv_timings, key=lambda t: t[0]) if gemv_timings else (None, None)
                if gemv is not None and gemv < tuned:   # the decode path runs the one-row kernel only where stored
                    best_configs[config_key("decode_gemv", device, (K, N, block_rank(args.rank)), torch.bfloat16)] = (
                        gemv_best)
                unsplit = min((us for us, cfg in timings if cfg.get("SPLIT_K", 1) == 1), default=None)
                # a group's configuration is stored at its total N (ops.decode looks it up there)
                dims = (rows_block(rows), K, N, block_rank(args.rank))
                best_configs[config_key("decode", device, dims, torch.bfloat16)] = best
                rows_out.append({"shape": shape, "projection": name, "K": K, "N": N, "rows": rows, "w_copies": n_copies,
                                 "merged_us": merged, "aten_us": aten, "default_us": default, "tuned_us": tuned,
                                 "unsplit_us": unsplit, "gemv_us": gemv, "gemv_config": gemv_best,
                                 "tuned_over_merged": tuned / merged, "aten_over_merged": aten / merged,
                                 "config": best})
                print(f"[{shape} {name} {K}->{'+'.join(map(str, widths))} rows {rows}] merged {merged:.2f} µs, "
                      f"aten {aten:.2f}, decode default {default if default is None else round(default, 2)}, "
                      f"tuned {tuned:.2f} {best}" + (f", one-row {gemv:.2f} {gemv_best}" if gemv is not None else ""),
                      flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(cache_path)), exist_ok=True)
    with open(cache_path, "w") as f:
        json.dump(best_configs, f, indent=1, sort_keys=True)
    command = "python bench/decode_kernels.py " + " ".join(argv if argv is not None else sys.argv[1:])
    paths = write_results("decode_kernels", rows_out, args.out, {"command": command})
    print_table(rows_out, ["shape", "projection", "rows", "merged_us", "aten_us", "default_us", "unsplit_us",
                           "gemv_us", "tuned_us", "tuned_over_merged"])
    with png(os.path.join(args.out, "decode_kernels.png"), figsize=(8, 3.5)) as ax:
        if ax is not None:
            labels = [f"{r['shape']} {r['projection']} x{r['rows']}" for r in rows_out]
            xs = range(len(rows_out))
            for offset, key in ((-0.27, "merged_us"), (0, "aten_us"), (0.27, "tuned_us")):
                ax.bar([i + offset for i in xs], [r[key] for r in rows_out], width=0.27, label=key[:-3])
            ax.set_xticks(list(xs), labels, rotation=90, fontsize=5)
            ax.set_ylabel("µs a call (GPU)")
            ax.legend(fontsize=7)
    print("wrote", *paths, cache_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
