"""Run the sits-lora command line end to end on this machine: check, bench, profile, compile (twice).

    PYTHONPATH=src python bench/cli_suite.py --out bench/results/cli        # about 3 minutes on an H200
    PYTHONPATH=src python bench/cli_suite.py --smoke --out /tmp/cli          # CPU: tiny shapes, checks the script

A random model with SmolLM2-135M's shapes (30 layers, hidden 576, MLP 1536, 9 heads, 3 KV heads,
bf16; no download) is written to OUT/model, then each command runs as its own process through
``python -m sits_lora`` (the entry point of the ``sits-lora`` script):

    check    --batch-size 4 --seq-len 2048                    -> OUT/check.json
    bench    the default suite                                -> OUT/bench/bench.json, bench.png
    profile  batch 4 x seq 512, r 16 on the 7 projections     -> OUT/profile/profile.csv, .png, .json
    compile  r 16 on q_proj and o_proj (576 x 576), cache in OUT/kernel_configs.json, twice: the second
             run must find every kernel cached               -> OUT/compile_1.json, OUT/compile_2.json

Each command's output goes to OUT/<name>.log; exit codes and wall times to OUT/cli_suite.json. The
script exits non-zero when a command fails to run or the second compile measures anything.
``--smoke``: a 2-layer model of width 64 and short sequences; without a GPU, compile is expected to
refuse (exit 2).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

SMOLLM2_SHAPES = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                      tie_word_embeddings=True, rms_norm_eps=1e-5)
TINY_SHAPES = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True)
PROJECTIONS = "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]"


def make_model(folder: str, shapes: dict) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**shapes)).to(torch.bfloat16)
    model.save_pretrained(folder)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "cli"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and sequences (a CPU check of this script)")
    args = parser.parse_args(argv)
    import torch

    gpu = torch.cuda.is_available()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    started = time.perf_counter()
    model = os.path.join(out, "model")
    make_model(model, TINY_SHAPES if args.smoke else SMOLLM2_SHAPES)
    seq = 64 if args.smoke else 512
    configs = {}
    for name, targets, batch, seq in (("profile", PROJECTIONS, 4, seq), ("compile", "[q_proj, o_proj]", 4, 4 * seq)):
        configs[name] = os.path.join(out, f"{name}.yaml")
        with open(configs[name], "w") as f:
            f.write(f"model: {model}\ntarget_modules: {targets}\nbatch_size: {batch}\nseq_len: {seq}\nr: 16\n")
    cache = os.path.join(out, "kernel_configs.json")
    steps = [
        ("check", ["check", "--config", configs["profile"], "--seq-len", str(4 * seq),
                   "--json", os.path.join(out, "check.json")], (0, 1)),
        ("bench", ["bench", "--out", os.path.join(out, "bench"), "--no-progress"], (0, 1)),
        ("profile", ["profile", "--config", configs["profile"], "--out", os.path.join(out, "profile")], (0,)),
        ("compile_1", ["compile", "--config", configs["compile"], "--cache", cache,
                       "--json", os.path.join(out, "compile_1.json")], (0,) if gpu else (2,)),
        ("compile_2", ["compile", "--config", configs["compile"], "--cache", cache,
                       "--json", os.path.join(out, "compile_2.json")], (0,) if gpu else (2,)),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.join(REPO, "src"),
                                                                     os.environ.get("PYTHONPATH")]))}
    record = {"model": model, "commands": []}
    failed = []
    for name, command, allowed in steps:
        t = time.perf_counter()
        with open(os.path.join(out, f"{name}.log"), "w") as log:
            code = subprocess.run([sys.executable, "-m", "sits_lora", *command], stdout=log, stderr=subprocess.STDOUT,
                                  env=env, cwd=REPO).returncode
        seconds = time.perf_counter() - t
        record["commands"].append({"name": name, "argv": ["sits-lora", *command], "exit_code": code, "seconds": seconds})
        print(f"{name:10} exit {code}  {seconds:6.1f} s  (log: {name}.log)", flush=True)
        if code not in allowed:
            failed.append(f"{name} exited {code}")
    second = os.path.join(out, "compile_2.json")
    if os.path.exists(second):
        with open(second) as f:
            tuned_again = json.load(f)["tuned"]
        record["second_compile_tuned"] = tuned_again
        if tuned_again:
            failed.append(f"the second compile measured {tuned_again} kernel(s) instead of reusing the cache")
    record["seconds"] = time.perf_counter() - started
    record["failed"] = failed
    with open(os.path.join(out, "cli_suite.json"), "w") as f:
        json.dump(record, f, indent=2)
    for name in ("check", "bench", "profile", "compile_1", "compile_2"):
        with open(os.path.join(out, f"{name}.log")) as f:
            text = f.read()
        print(f"\n===== {name}\n" + text[-6000:])
    print(f"\ncli suite: {record['seconds']:.0f} s" + (f"; FAILED: {'; '.join(failed)}" if failed else ", all ran"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
