"""Writes the adapters that tests/tuner/test_release_adapters.py loads: a tiny random Llama (saved whole, so the
test does not depend on how a torch version draws random weights), SITS_LORA adapters of a few configurations on it,
one batch of token ids and each adapter's logits on it, as this revision of sits_lora computes them.

Run it at the revision whose adapters must keep loading, with that revision's package first on the path:

    git worktree add /tmp/old REV && PYTHONPATH=/tmp/old/src python tests/tuner/release_adapters/make.py

It only uses what a user would: ``get_peft_model``, ``save_pretrained`` and the model's forward."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import peft
import torch
import transformers
from peft import get_peft_model
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

import sits_lora

HERE = os.path.dirname(os.path.abspath(__file__))
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# name -> SitsLoraConfig arguments; each one a kind of adapter a user of that release could have saved
ADAPTERS = {
    "default": dict(r=4, lora_alpha=8, target_modules=TARGETS),
    "attention_only_rslora": dict(r=6, lora_alpha=12, use_rslora=True, target_modules=["q_proj", "v_proj"],
                                  fuse_siblings=False),
    "dynamic_rank": dict(r=8, lora_alpha=16, target_modules=TARGETS, use_dynamic_rank=True, rank_buckets=[2, 4, 8],
                         rank_scheduler="learned", target_mean_rank=4.0),
    "int4_base": dict(r=4, lora_alpha=8, target_modules=TARGETS, base_quant="int4", int4_group_size=32),
    "fp8_base_emulated": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], fp8="hybrid",
                              fp8_emulate=True, fp8_layers="all"),
    # the default scheduler: each router reads the entropy its layer's probe predicts (fitted below as
    # TokenEntropySampler leaves a probe: weights set, ``fitted`` on)
    "dynamic_rank_entropy_gated": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                                       use_dynamic_rank=True, rank_buckets=[2, 4, 8], rank_scheduler="entropy-gated",
                                       target_mean_rank=4.0),
}


def _base() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _revision() -> str:
    source = os.path.dirname(sits_lora.__file__)
    try:
        return subprocess.run(["git", "-C", source, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    base_dir = os.path.join(HERE, "base")
    base = _base()
    base.save_pretrained(base_dir, safe_serialization=True)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, base.config.vocab_size, (2, 12), generator=generator)
    outputs = {"input_ids": input_ids}
    for name, arguments in ADAPTERS.items():
        model = get_peft_model(LlamaForCausalLM.from_pretrained(base_dir).eval(), sits_lora.SitsLoraConfig(**arguments))
        with torch.no_grad():  # PEFT starts lora_B at zero; an adapter that changes nothing would prove nothing
            for parameter in model.parameters():
                if parameter.requires_grad:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
            for key, parameter in model.named_parameters():   # an entropy probe: frozen, fitted apart from training
                if "lora_entropy_probe" in key and not parameter.requires_grad:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
            for key, buffer in model.named_buffers():
                if "lora_entropy_probe" in key and key.endswith(".fitted"):
                    buffer.fill_(True)
            for key, parameter in model.named_parameters():   # large enough that the probe decides some buckets
                if key.endswith("entropy_weight"):
                    parameter.mul_(50)
        model.eval()
        model.save_pretrained(os.path.join(HERE, name))
        os.remove(os.path.join(HERE, name, "README.md"))  # PEFT's model card: nothing the load reads
        with torch.no_grad():
            outputs[name] = model(input_ids=input_ids).logits.float().contiguous()
        print(name, "saved")
    save_file(outputs, os.path.join(HERE, "logits.safetensors"))
    made_by = dict(sits_lora_revision=_revision(), torch=torch.__version__, peft=peft.__version__,
                   transformers=transformers.__version__, adapters=ADAPTERS)
    with open(os.path.join(HERE, "made_by.json"), "w") as f:
        json.dump(made_by, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
