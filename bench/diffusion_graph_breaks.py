"""How torch.compile splits one diffusers transformer block with a sits_lora adapter, with and without the
cross-attention K / V kept under compile (sits_lora.siblings' ``keep_under_compile``, what compile_blocks sets).

    python bench/diffusion_graph_breaks.py --out OUT      # CPU or GPU: a tiny U-Net's first transformer block

Each graph dynamo hands the backend is listed with its operator count, first and last operators: a break splits the
block, and inductor cannot fuse across the pieces (a LayerNorm with the fp8 cast of the projection after it, a
projection's output with the residual add). Writes OUT/diffusion_graph_breaks.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "diffusion"))


def op_name(node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def graphs_of_block(keep: bool) -> list[dict]:
    from test_diffusers_models import tiny_unet

    from sits_lora import SitsLoraConfig
    from sits_lora.diffusion.reuse import cross_attention_groups

    torch.manual_seed(0)
    unet = tiny_unet().eval()
    unet.add_adapter(SitsLoraConfig(r=4, lora_alpha=8, target_modules=["attn2.to_k", "attn2.to_v"],
                                    init_lora_weights=False))
    for group in cross_attention_groups(unet):
        group.keep_under_compile = keep
    block = unet.down_blocks[0].attentions[0].transformer_blocks[0]
    graphs = []

    def backend(gm, inputs):
        graphs.append([op_name(n) for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")])
        return gm.forward

    torch._dynamo.reset()
    hidden, text = torch.randn(2, 64, 32), torch.randn(2, 7, 24)
    compiled = torch.compile(block, backend=backend)
    with torch.no_grad():
        for _ in range(2):   # the second call answers from the kept K / V
            compiled(hidden, encoder_hidden_states=text)
    return [{"ops": len(ops), "first": ops[:5], "last": ops[-3:]} for ops in graphs]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    result = {"torch": torch.__version__}
    for keep in (True, False):
        rows = graphs_of_block(keep)
        result[f"keep_under_compile={keep}"] = rows
        print(f"keep_under_compile={keep}: {len(rows)} graph(s)")
        for i, row in enumerate(rows):
            print(f"  graph {i}: {row['ops']} ops, {row['first']} ... {row['last']}")
    with open(os.path.join(args.out, "diffusion_graph_breaks.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
