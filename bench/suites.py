"""The suites of ``python -m bench``: every script in bench/ under the one thing it measures."""

import ast
import os

HERE = os.path.dirname(os.path.abspath(__file__))

# suite -> its scripts, the first one the default; grouped by what they measure
SUITES = {
    "gate": ["regress"],
    "step": ["bench_model", "trl_loop", "trainer_step", "graph_breaks", "profile_host"],
    "layer": ["bench_layer", "bench_parts", "profile_layer", "profile_rebuild", "bench_dynamic_rank_layer",
              "decode_kernels", "tune_kernels"],
    "memory": ["longest_context", "memory_plan", "memory_plan_vs_model"],
    "quantization": ["bench_int4", "base_quant_quality", "fp8_gemms", "fp8_quality", "fp8_summary", "fp8_conv"],
    "serving": ["serve"],
    "diffusion": ["diffusion", "profile_diffusion", "diffusion_graph_breaks"],
    "quality": ["unsloth_quality", "dynamic_rank_eval", "rank_budget_trace"],
    "multi-gpu": ["multi_gpu"],
    "tools": ["report", "archive", "gpu_run", "peft_suite", "cli_suite", "carry_unsloth"],
}
# modules the scripts import, not run on their own
LIBRARIES = ("harness", "dynamic_rank_harness", "suites")


def summary(script: str) -> str:
    """The first line of a script's docstring."""
    with open(os.path.join(HERE, script + ".py")) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    return doc.splitlines()[0] if doc else ""
