"""One runner for a device call: ``python -m bench run RUN OUT [PART ...] [-- ARGS ...]`` from the repository root.

    python -m bench run                                  # the runs and their parts, one line each
    python -m bench run gate OUT -- --shapes 1b --repeats 3 --arms frozen+liger sits+default
    python -m bench run memory OUT context               # one part of a run
    python -m bench run dynamic-rank OUT routed --model smollm2.gguf
    python -m bench run gate OUT --dry-run               # print the commands, run nothing

A run is the GPU tests of what it measures, then its benchmark scripts, each part a process with its own time
limit and log (``OUT/PART.log``); every part runs even when an earlier one failed, and the exit status is the
worst. Before the first part, the wheels the GPU image lacks, carried in ``.whl/``, are installed into /tmp/site
and the source tree goes on PYTHONPATH (bench/gpu_env.sh says how to make ``.whl/``; sourced, it sets up an ad-hoc
command the same way). ``ARGS`` after ``--`` go to the run's main script; ``--pack`` ends with OUT as one OUT.tgz
(a device call returns only a few files).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suites import summary  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = "/tmp/site"
SITE_UNSLOTH = "/tmp/site_unsloth"   # its own folder: Unsloth pins older trl and datasets than .whl/ carries
PYTEST = ["{python}", "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rfE", "--tb=short", "--durations=15", "-m",
          "gpu"]
# noise the benchmark scripts print on every call (torch's and transformers' warnings, glog lines), kept in the
# log only; so are pytest -v's per-test lines (the summary at the end names each failure)
NOISE = re.compile(r"Warning|warnings\.warn|^W\d{4} |^tests/\S+::")


@dataclass
class Part:
    """One process of a run: ``command`` with {python} (this interpreter), {out}, {args} and {model} filled in,
    killed after ``timeout`` s."""
    command: list
    timeout: int
    default: bool = True           # runs when no part is named
    doc: str = ""
    env: dict = field(default_factory=dict)   # set for this part and every later one (a tuning cache it wrote)
    min_gpus: int = 0              # skipped on a machine with fewer GPUs
    max_gpus: int = 1 << 30        # skipped on a machine with more
    unsloth: bool = False          # Unsloth's wheels (.whl_unsloth/, when carried) first on its PYTHONPATH


@dataclass
class Run:
    doc: str
    parts: dict


def tests(*paths: str, timeout: int = 180) -> Part:
    return Part(PYTEST + list(paths), timeout, doc="the GPU tests of " + " ".join(paths))


def script(name: str, *arguments: str, timeout: int = 590, **options) -> Part:
    return Part(["{python}", f"bench/{name}.py", *arguments], timeout, **options)


RUNS = {
    "gate": Run("the compile GPU tests, the host profile, then the gate (regress.py; ARGS go to it)", {
        "fp8-crossover": script("tune_kernels", "--fp8", "--no-kernels", "--out", "{out}/tune", default=False,
                                env={"SITS_LORA_TUNING_CACHE": "{out}/tune/kernel_configs.json"},
                                doc="where the fp8 base pays per layer shape; later parts use it (fp8_layers='auto')"),
        "tests": tests("tests/tuner/test_compile_gpu.py"),
        "all-tests": Part(PYTEST + ["--ignore=tests/docs", "tests"], 500, default=False,
                          doc="every test marked gpu but the docs tests (their notebook runner is not in the image)"),
        "host": script("profile_host", "--out", "{out}/host", timeout=120),
        "gate": script("regress", "--out", "{out}/regress", "{args}"),
    }),
    "trl": Run("the loop users run: the native step's GPU tests, then trl_loop.py (ARGS go to it; the Unsloth arms "
               "take .whl_unsloth/)", {
        "tests": tests("tests/training/test_trl.py", "tests/training/test_step_recording.py",
                       "tests/ops/test_cross_entropy.py", timeout=300),
        "loop": script("trl_loop", "--out", "{out}/loop", "{args}"),
    }),
    "8b": Run("where the GPU hours go: the 8B step (fp8 base recorded) and whole-8B QLoRA against Unsloth, fp8 and "
              "4-bit quality, the longest 4-bit context. Carry .whl and .whl_unsloth (Unsloth, bitsandbytes)", {
        "tests": tests("tests/fp8/test_fp8_step.py", "tests/fp8/test_fp8_gpu.py", "tests/int4/test_bnb4_fp8.py",
                       "tests/training/test_step_recording.py", timeout=240),
        "step": script("regress", "--out", "{out}/regress_8b", "--no-graph-breaks", "--shapes", "8b", "--repeats", "1",
                       "--arm-timeout", "120", "--arms", "{args}", unsloth=True,
                       doc="8B, 4 layers: the floor, the default step in bf16 and over the fp8 base, Unsloth"),
        "qlora": script("regress", "--out", "{out}/regress_8b_full", "--no-graph-breaks", "--shapes", "8b-full",
                        "--repeats", "1", "--arm-timeout", "140", "--arms", "sits+nf4+default", "sits+nf4+fp8+liger",
                        "sits+nf4+fp8+default", "unsloth+nf4", unsloth=True,
                        doc="all 32 layers, NF4 storage: bf16 and fp8 compute, recorded, against Unsloth's QLoRA"),
        "quality": script("base_quant_quality", "--out", "{out}/quality", "--arms", "off", "fp8", "nf4", "nf4+fp8",
                          "--seeds", "0", "1", "2", "--", "--max-steps", "200", default=False,
                          unsloth=True, doc="SmolLM2's held-out loss after 200 steps per frozen base, 3 seeds "
                                            "(resumable: finished runs are kept)"),
        "unsloth-quality": script("unsloth_quality", "--out", "{out}/unsloth_quality", default=False, unsloth=True,
                                  doc="our loss at step 50 against the spread of Unsloth's 3 seeds"),
        "context": script("longest_context", "--measure", "--model", "8b", "--arms", "sits+nf4+liger+offload",
                          "unsloth+nf4+gc", "--max-tokens", "491520", "--probe-timeout", "240", "--arm-timeout", "290",
                          "--out", "{out}/context_4bit", default=False, unsloth=True,
                          doc="the longest context at batch 1 under 80 GiB, 8B with a 4-bit base, all 32 layers"),
    }),
    "memory": Run("activation memory: GPU tests, the longest context, the gate's memory arms, the rebuild profile", {
        "tests": tests("tests/activations", timeout=120),
        "context": script("longest_context", "--measure", "--model", "8b", "--layers", "4", "--max-tokens", "450560",
                          "--arms", "frozen+liger", "sits+liger", "peft", "peft+gc", "sits+liger+offload",
                          "--probe-timeout", "200", "--arm-timeout", "330", "--out", "{out}/context", default=False,
                          doc="8B, 4 layers standing for 32, up to the plan's 12x point"),
        "context-rest": script("longest_context", "--measure", "--model", "8b", "--layers", "4", "--max-tokens",
                               "36864", "--arms", "peft+gc", "sits+liger+gc", "sits+liger+offload", "--probe-timeout",
                               "30", "--arm-timeout", "90", "--out", "{out}/context_same_length", default=False,
                               doc="tokens/s of the checkpointed arms at one length"),
        "context-full": script("longest_context", "--measure", "--model", "8b", "--arms", "sits+liger+offload",
                               "--max-tokens", "409600", "--probe-timeout", "560", "--arm-timeout", "580", "--out",
                               "{out}/context_full", default=False,
                               doc="the offloaded arm on all 32 layers, one step (the host holds 32 layers' "
                                   "activations, pinned)"),
        "gate": script("regress", "--out", "{out}/regress", "--shapes", "8b", "1b", "--no-graph-breaks",
                       "--arm-timeout", "130", "--arms", "frozen+compile", "frozen+liger", "peft+compile", "sits",
                       "sits+compile", "sits+liger", "sits+liger+saved", "sits+fp8+liger", default=False,
                       doc="regress.py's memory arms on both shapes"),
        "profile": script("profile_rebuild", "--out", "{out}/profile_rebuild", timeout=120, default=False,
                          doc="1B sits + Liger, inputs rebuilt vs saved, under the profiler"),
    }),
    "fp8": Run("the fp8 base: its GPU tests, one layer, the 8B model (ARGS: its arms), the summary", {
        "tests": tests("tests/fp8/test_fp8_gpu.py"),
        "layer": script("bench_layer", "--arms", "frozen", "sits:cublas", "sits:fp8", "--ranks", "16",
                        "--out", "{out}", timeout=150),
        "model": script("bench_model", "--model", "8b", "--warmup", "2", "--steps", "5", "--out", "{out}", "--arms",
                        "{args}", timeout=300, doc="default arms: frozen frozen+compile sits+fp8 sits+fp8+compile"),
        "summary": script("fp8_summary", "{out}", timeout=60),
    }),
    "int4": Run("the 4-bit bases: their GPU tests, the kernels, one layer, its profile, the 8B model's 32 layers", {
        "tests": tests("tests/int4", timeout=120),
        "kernels": script("bench_int4", "--out", "{out}/kernels", timeout=150),
        "layer": script("bench_layer", "--ranks", "16", "--tokens", "8192", "--arms", "frozen", "sits:cublas",
                        "sits:int4", "sits:nf4", "sits:nf4:bitsandbytes", "peft:nf4", "--out", "{out}/layer",
                        timeout=100),
        "profile": script("profile_layer", "--d-in", "2048", "--d-out", "8192", "--arms", "sits:cublas", "sits:int4",
                          timeout=60),
        "full": script("regress", "--out", "{out}/regress_8b_full", "--no-graph-breaks", "--shapes", "8b-full",
                       "--arm-timeout", "150", "--arms", "{args}", timeout=300,
                       doc="default arms: sits+liger peft+nf4 sits+nf4+liger sits+nf4+bnbdq+liger sits+int4+liger"),
    }),
    "serving": Run("serving: its GPU tests, the decode kernels (optional), then serve.py (ARGS go to it)", {
        "tests": tests("tests/serving", "tests/ops/test_aten_path.py", "tests/ops/test_decode.py"),
        "decode": script("decode_kernels", "--out", "{out}/decode", default=False,
                         env={"SITS_LORA_TUNING_CACHE": "{out}/decode/decode_configs.json"},
                         doc="the decode kernel against the merged GEMM, tuned; serve then uses its configurations"),
        "serve": script("serve", "--out", "{out}/serve", "{args}"),
    }),
    "diffusion": Run("diffusion: its GPU tests (and the recorded training step's), then diffusion.py (ARGS go to it)", {
        "tests": tests("tests/diffusion", "tests/ops/test_aten_path.py", "tests/training/test_graph_train_step.py",
                       "tests/recipe/test_train_diffusion.py"),
        "diffusion": script("diffusion", "--out", "{out}/diffusion", "{args}"),
    }),
    "multi-gpu": Run("several processes: the recipe under accelerate's configs, then multi_gpu.py (ARGS go to it)", {
        "tests": tests("tests/recipe/test_recipe_accelerate_gpu.py", timeout=240),
        "world-1": script("multi_gpu", "--out", "{out}/multi", "--world", "1", "{args}", max_gpus=1,
                          doc="each wrapper (DDP, FSDP2) over a one-rank group: the code path and its cost"),
        "scaling": script("multi_gpu", "--out", "{out}/multi", "{args}", min_gpus=2),
        "curve": script("multi_gpu", "--out", "{out}/curve", "--loss-curve", min_gpus=2),
    }),
    "dynamic-rank": Run("per-token rank, one part per call (--model: the GGUF or any spec the recipe loads)", {
        "trace": Part(["bash", "-c", "for arm in entropy-gated learned; do {python} bench/rank_budget_trace.py "
                       "--size budget --steps 80 --model {model} --arm $arm --rules price:2 price:6 "
                       "--out {out}/trace/$arm || exit 1; done"], 590, default=False,
                      doc="the budget rule at the evaluation's batch: price with step 2 against 6, two schedulers"),
        "static": script("dynamic_rank_eval", "--budget", "--model", "{model}", "--arms",
                         "static-r16,static-r64,nested-r64,learned", "--lr", "static-r16=1e-3,static-r64=1e-3",
                         "--lr-grid", "2e-3,4e-3", "--rank-budget-mode", "price", "--out", "{out}/static",
                         default=False, doc="the evaluation's static arms"),
        "routed": script("dynamic_rank_eval", "--budget", "--model", "{model}", "--arms", "entropy-gated,random",
                         "--lr-grid", "2e-3,4e-3", "--rank-budget-mode", "price", "--out", "{out}/routed",
                         default=False, doc="entropy-gated and random (which takes entropy-gated's histogram)"),
        "layer": script("bench_dynamic_rank_layer", "--out", "{out}/layer", default=False,
                        doc="the per-token-rank layer against the static kernel, router compiled and eager"),
    }),
}
# a part's arguments when none follow "--"
DEFAULT_ARGS = {("fp8", "model"): ["frozen", "frozen+compile", "sits+fp8", "sits+fp8+compile"],
                ("8b", "step"): ["frozen+liger", "frozen+liger+cudnn", "sits+default", "sits+default+cudnn",
                                 "sits+fp8+liger", "sits+fp8+default", "unsloth"],
                ("int4", "full"): ["sits+liger", "peft+nf4", "sits+nf4+liger", "sits+nf4+bnbdq+liger",
                                   "sits+int4+liger"]}


def listing() -> str:
    lines = ["python -m bench run RUN OUT [PART ...] [-- ARGS ...]; without PART, the parts marked *", ""]
    for name, run in RUNS.items():
        lines.append(f"{name}: {run.doc}")
        for part_name, part in run.parts.items():
            mark = "*" if part.default else " "
            named = part.command[1] if part.command[0] == "{python}" else ""
            what = part.doc or (summary(os.path.basename(named)[:-3]) if named.startswith("bench/") else "")
            lines.append(f"  {mark} {part_name:<14} {what}")
    return "\n".join(lines)


def command_of(run: str, part_name: str, part: Part, out: str, args: list, model: str | None) -> list:
    filled = []
    for word in part.command:
        if word == "{args}":
            filled += args or DEFAULT_ARGS.get((run, part_name), [])
        else:
            for placeholder, value in (("{out}", out), ("{model}", model or ""), ("{python}", sys.executable)):
                word = word.replace(placeholder, value)
            filled.append(word)
    return filled


def environment() -> dict:
    """The children's environment: the carried wheels installed into SITE, the source tree first on PYTHONPATH."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [os.path.join(REPO, "src")]
    wheels = sorted(glob.glob(os.path.join(REPO, ".whl", "*.whl")))
    if wheels:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                               "--no-cache-dir", "--upgrade", "--target", SITE, *wheels])
        if done.returncode == 0:
            paths.append(SITE)
        else:
            print(f"the wheels in .whl/ did not install (pip exit {done.returncode}); running without them",
                  flush=True)
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def unsloth_site() -> str:
    """SITE_UNSLOTH with the wheels of .whl_unsloth/ installed ("" when they were not carried or did not install)."""
    wheels = sorted(glob.glob(os.path.join(REPO, ".whl_unsloth", "*.whl")))
    if not wheels:
        return ""
    if not os.path.isdir(SITE_UNSLOTH):
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                               "--no-cache-dir", "--target", SITE_UNSLOTH, *wheels])
        if done.returncode != 0:
            print(f"the wheels in .whl_unsloth/ did not install (pip exit {done.returncode})", flush=True)
            shutil.rmtree(SITE_UNSLOTH, ignore_errors=True)
            return ""
    return SITE_UNSLOTH


def gpu_count() -> int:
    if not shutil.which("nvidia-smi"):
        return 0
    listed = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,temperature.gpu",
                             "--format=csv,noheader"], capture_output=True, text=True)
    print(listed.stdout.strip(), flush=True)
    return len(listed.stdout.strip().splitlines()) if listed.returncode == 0 else 0


def run_part(command: list, timeout: int, log: str, env: dict) -> int:
    """Run one part, its output into ``log`` and, less the noise, onto the screen; its exit status, 124 when it ran out
    of time, 128 + N when signal N killed it."""
    with open(log, "w") as sink:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, start_new_session=True)
        stopped = threading.Event()

        def stop():  # the whole process group: a part's own children (a benchmark's arms) go with it
            stopped.set()
            os.killpg(process.pid, signal.SIGKILL)

        timer = threading.Timer(timeout, stop)
        timer.start()
        try:
            for line in process.stdout:
                sink.write(line)
                if not NOISE.search(line):
                    print(line, end="", flush=True)
            status = process.wait()
        finally:
            timer.cancel()
        if stopped.is_set():
            sink.write(f"\n[stopped after {timeout} s]\n")
            return 124
        # a part killed by a signal (a crash, the kernel's OOM killer) reads as the shell writes it, 128 + the signal:
        # Popen's negative status would lose to a clean part's 0 in the run's worst status
        return 128 - status if status < 0 else status


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args_after = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(listing())
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench run", description=__doc__.splitlines()[0])
    parser.add_argument("run", choices=list(RUNS))
    parser.add_argument("out", help="the folder for the logs and results (made if missing)")
    parser.add_argument("parts", nargs="*", help="the parts to run, in this order (default: the run's marked parts)")
    parser.add_argument("--model", help="the model the dynamic-rank parts train (a GGUF path or a recipe spec)")
    parser.add_argument("--pack", action="store_true", help="end with OUT as one OUT.tgz (OUT removed)")
    parser.add_argument("--dry-run", action="store_true", help="print each part's command and run nothing")
    options = parser.parse_args(argv)
    run = RUNS[options.run]
    unknown = [p for p in options.parts if p not in run.parts]
    if unknown:
        parser.error(f"run {options.run!r} has no part {unknown[0]!r}; its parts: {', '.join(run.parts)}")
    names = options.parts or [p for p, part in run.parts.items() if part.default]
    needs_model = [p for p in names if "{model}" in " ".join(run.parts[p].command)]
    if needs_model and not options.model:
        parser.error(f"part {needs_model[0]!r} trains a model: give it with --model PATH (the SmolLM2 GGUF, say)")
    out = os.path.abspath(options.out)
    commands = [(p, command_of(options.run, p, run.parts[p], out, args_after, options.model)) for p in names]
    if options.dry_run:
        for p, command in commands:
            print(f"{p} ({run.parts[p].timeout} s): {' '.join(command)}")
        return 0
    os.makedirs(out, exist_ok=True)
    env, gpus, worst = environment(), gpu_count(), 0
    for p, command in commands:
        part = run.parts[p]
        if not part.min_gpus <= gpus <= part.max_gpus:
            print(f"== {p}: skipped (for {part.min_gpus} to {part.max_gpus} GPUs; this machine has {gpus})", flush=True)
            continue
        print(f"== {p}: {' '.join(command)}", flush=True)
        part_env = env
        if part.unsloth and unsloth_site():
            part_env = dict(env, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "src"), SITE_UNSLOTH, env["PYTHONPATH"]]))
        status = run_part(command, part.timeout, os.path.join(out, f"{p}.log"), part_env)
        if status:
            stopped = f" (stopped after {part.timeout} s)" if status == 124 else ""
            print(f"== {p}: exit {status}{stopped}", flush=True)
        worst = max(worst, status)
        env.update({k: v.replace("{out}", out) for k, v in part.env.items()})
    if options.pack:
        with tarfile.open(out + ".tgz", "w:gz") as archive:
            archive.add(out, arcname=os.path.basename(out))
        shutil.rmtree(out)
    return worst


if __name__ == "__main__":
    sys.exit(main())
