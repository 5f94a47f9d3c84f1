"""Graph breaks of torch.compile through a sits_lora model, per configuration, with their reasons.

    python bench/graph_breaks.py --out OUT          # GPU: the Triton path, bf16, every configuration
    python bench/graph_breaks.py --smoke            # CPU: the same configurations on the PyTorch path

A 2-layer Llama with SitsLoraConfig on all seven projections, in training mode, through
``torch._dynamo.explain`` (forward with labels; the backward of a compiled graph cannot break). Each
break is reported once per (reason, place in our code or the library's), with how often it occurred:
a break inside every adapted layer shows up as one row with count 14. Configurations: the static
adapter with sibling fusion (the default) and without, under bf16 autocast on an fp32 model, the fp8
base (emulated on a CPU), and the dynamic-rank adapters (nested 'static' and routed 'random').

Then the same model compiled, three calls with the same inputs: the graphs compiled after the first call
("recompiles", 0 unless a guard fails every call).

Writes OUT/graph_breaks.json; exit status 1 when any configuration breaks or compiles again (bench/regress.py
counts them the same way).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections import Counter

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# name -> (SitsLoraConfig overrides, model dtype on the GPU, autocast dtype or None)
CONFIGS = {
    "static": (dict(), torch.bfloat16, None),
    "static, no siblings": (dict(fuse_siblings=False), torch.bfloat16, None),
    "static, fp32 model under bf16 autocast": (dict(), torch.float32, torch.bfloat16),
    "fp8 hybrid": (dict(fp8="hybrid", fp8_layers="all"), torch.bfloat16, None),
    "dynamic rank, nested (static)": (dict(use_dynamic_rank=True, rank_buckets=[8, 16], rank_scheduler="static"),
                                      torch.bfloat16, None),
    "dynamic rank, random router": (dict(use_dynamic_rank=True, rank_buckets=[8, 16], rank_scheduler="random",
                                         target_mean_rank=12.0), torch.bfloat16, None),
}


def _model(overrides: dict, dtype, device: str):
    from peft import get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from sits_lora import SitsLoraConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model.config.use_cache = False
    overrides = dict(overrides)
    if overrides.get("fp8") and device == "cpu":
        overrides["fp8_emulate"] = True
    model = get_peft_model(model, SitsLoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, **overrides))
    model.train()
    return model


def _place(frame) -> str:
    """The innermost frame of a break's stack that is ours (sits_lora), else the innermost one."""
    if not frame:
        return "?"
    ours = [f for f in frame if "sits_lora" in f.filename]
    f = (ours or frame)[-1]
    path = f.filename
    for marker in ("sits_lora/", "site-packages/"):
        if marker in path:
            path = path.split(marker, 1)[1] if marker == "site-packages/" else "sits_lora/" + path.split(marker, 1)[1]
            break
    return f"{path}:{f.lineno} {f.name}"


def count_breaks(name: str, device: str) -> dict:
    """{"config", "graph_breaks", "graphs", "breaks": [{"reason", "where", "count"}]} for one configuration."""
    overrides, dtype, autocast = CONFIGS[name]
    if device == "cpu":
        dtype = torch.float32
        autocast = torch.bfloat16 if autocast is not None else None
    torch._dynamo.reset()
    model = _model(overrides, dtype, device)
    ids = torch.randint(0, 256, (2, 16), device=device, generator=torch.Generator(device=device).manual_seed(0))
    context = torch.autocast(device, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with context:
        explanation = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
    reasons = Counter()
    for info in explanation.break_reasons:
        reason = str(info.reason).strip().splitlines()[0][:300]
        reasons[(reason, _place(info.user_stack))] += 1
    return {
        "config": name,
        "graph_breaks": explanation.graph_break_count,
        "graphs": explanation.graph_count,
        "recompiles": count_recompiles(model, ids, context),
        "breaks": [{"reason": r, "where": w, "count": c} for (r, w), c in reasons.most_common()],
    }


def count_recompiles(model, ids, context, calls: int = 3) -> int:
    """Graphs compiled by the calls after the first, with the same inputs: a guard that fails at every call (a
    value the traced code changes, such as a counter) compiles the model again each step. The CUDA-graph wrappers'
    AdapterState sets a global module-registration hook, which a model slicing its ModuleList in forward (as
    transformers' Llama does) calls while it is traced: one is made first, as they would."""
    from sits_lora.utils.cuda_graphs import AdapterState

    AdapterState(model)()
    torch._dynamo.reset()
    compiled_graphs = []

    def backend(graph_module, example_inputs):
        compiled_graphs.append(graph_module)
        return graph_module.forward

    compiled = torch.compile(model, backend=backend)
    with context:
        compiled(input_ids=ids, labels=ids)
        first = len(compiled_graphs)
        for _ in range(calls - 1):
            compiled(input_ids=ids, labels=ids)
    return len(compiled_graphs) - first


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--out", default=None, help="folder for graph_breaks.json")
    parser.add_argument("--smoke", action="store_true", help="the CPU and the PyTorch path, whatever the machine")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        print("note: TRITON_INTERPRET=1 runs the Triton path on the CPU (slow); unset it for the PyTorch path")
    rows = []
    for name in args.configs:
        try:
            row = count_breaks(name, device)
        except Exception as error:  # one configuration that fails to run is reported, the others still run
            row = {"config": name, "error": f"{type(error).__name__}: {error}"[:500]}
        rows.append(row)
        if "error" in row:
            print(f"[{name}] failed: {row['error']}", flush=True)
            continue
        print(f"[{name}] {row['graph_breaks']} graph breaks, {row['graphs']} graphs, {row['recompiles']} "
              "recompiles on the next calls", flush=True)
        for b in row["breaks"]:
            print(f"    {b['count']:3d} x {b['where']}: {b['reason']}", flush=True)
    if args.out:
        from harness import environment

        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "graph_breaks.json"), "w") as f:
            json.dump({"environment": environment(), "device": device, "configs": rows}, f, indent=1)
    return 0 if all(r.get("graph_breaks") == 0 and r.get("recompiles") == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
