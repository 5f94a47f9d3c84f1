"""A whole training step on Llama-3 shapes: the frozen floor, PEFT and sits_lora, eager and compiled.

    python bench/bench_model.py --model 1b          # GPU: Llama-3.2-1B shape, bs 4 x seq 2048, bf16
    python bench/bench_model.py --model 8b
    python bench/bench_model.py --model 0.5b        # the Llama architecture at Qwen2.5-0.5B's widths (MODELS)
    python bench/bench_model.py --model tiny --smoke  # CPU: checks the script in seconds

Random bf16 weights, sdpa attention, LoRA r = 16, alpha 32, dropout 0 on q, k, v, o, gate, up,
down; AdamW (fused) on the adapter. "frozen" = every weight frozen, the input embeddings require
grad: the floor any LoRA step must pay. "The floor" is the fastest frozen step among eager,
torch.compile, Liger-Kernel and Liger + compile measured in the same run (FLOOR_ARMS, those of them that
ran). Each arm runs in its own process (clean memory statistics, no
monkey-patching leaking between arms); the parent writes JSON, CSV and a PNG.

The Unsloth arms (UNSLOTH_ARMS, off by default) load the same random weights through
``FastLanguageModel.from_pretrained(<folder>)``: the shape is written once as a local checkpoint folder (weights,
config and a placeholder tokenizer; no hub), and LoRA gets the same rank, alpha, dropout and projections
(``LORA``). Where unsloth is not installed the arm stops with one line saying so (docs/unsloth.md: how it is
carried to the GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import print_table, write_results  # noqa: E402

MODELS = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),
    # the Llama architecture at Qwen2.5-0.5B's widths (head_dim 896 / 14 = 64): Qwen2 adds biases to q, k and v,
    # which LlamaConfig(attention_bias=False) leaves out; the same build path as the Llama-3 shapes
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False, rope_theta=10000.0),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# every LoRA arm's adapter: PEFT's, sits_lora's and Unsloth's
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS)
ARMS = ["frozen", "frozen+compile", "peft", "peft+compile", "sits", "sits+compile"]
# the frozen arms whose fastest step is "the floor"
FLOOR_ARMS = ("frozen", "frozen+compile", "frozen+liger", "frozen+liger+compile", "frozen+compile+cg",
              "frozen+liger+nolce", "frozen+liger+cudnn")
# "+cg": torch.compile(mode="reduce-overhead"), CUDA graphs over the compiled forward and backward: the fp8
# layers are launch-bound (bench/NOTES.md, session 3); the frozen floor is measured the same way next to them
OPTIONAL_ARMS = ["peft+liger", "sits+liger", "sits+gc", "peft+gc", "sits+fp8", "sits+fp8+compile",
                 "frozen+compile+cg", "sits+compile+cg", "sits+fp8+compile+cg",
                 # Liger's fused RMSNorm / SwiGLU / linear cross-entropy under the fp8 base, and the frozen
                 # model with Liger: the floor for a run that uses Liger, reported next to the floor
                 "sits+fp8+liger", "frozen+liger", "frozen+liger+compile", "sits+liger+compile",
                 # "+saved": recompute_lora_inputs=False, the LoRA layers save their inputs (sits_lora.activations)
                 "sits+saved", "sits+liger+saved",
                 # "+offload": gradient checkpointing with the layer inputs in pinned host memory and the MLP in tiles
                 # of 8192 tokens (sits_lora.activations), the long-context setting
                 "sits+liger+offload",
                 # 4-bit frozen bases: "+nf4" the projections as bitsandbytes NF4 layers (QLoRA; PEFT's layer or
                 # sits_lora's fused one), "+int4" sits_lora's own INT4 base
                 "peft+nf4", "sits+nf4", "sits+int4", "peft+nf4+liger", "sits+nf4+liger", "sits+int4+liger",
                 # "+bnbdq": the NF4 weights dequantized by bitsandbytes' dequantize_4bit, not sits_lora's kernel
                 "sits+nf4+bnbdq", "sits+nf4+bnbdq+liger",
                 # "+nf4+fp8": NF4 storage, fp8 compute (fp8="hybrid" over the 4-bit layers: W formed in e4m3 per GEMM)
                 "sits+nf4+fp8", "sits+nf4+fp8+liger",
                 # "+graph": the whole step (forward, loss, backward, optimizer) recorded as one CUDA graph by
                 # sits_lora.training.graph_train_step after two eager steps and replayed: the host's time leaves the
                 # step. Not part of the floor: graphed arms are compared with the graphed frozen arm
                 # (bench/regress.py). With Liger: without its fused linear cross-entropy (a host sync; see build)
                 "frozen+graph", "frozen+liger+graph", "peft+graph", "peft+liger+graph", "sits+graph",
                 "sits+liger+graph",
                 # "+nolce": Liger without its fused linear cross-entropy, eager (what its two host syncs a step cost
                 # a host-bound arm, against the logits it saves)
                 "frozen+liger+nolce", "sits+liger+nolce",
                 # "+default": the step NativeLoraTrainer runs by default on a GPU
                 # (sits_lora.training.default_train_step: its own sync-free fused linear cross-entropy, clipping,
                 # CUDA graphs after warm-up) over Liger's RMSNorm, SwiGLU and RoPE; "+nf4+default" the same step
                 # over the projections as bitsandbytes NF4 layers; "+fp8+default" over the fp8 base, its delayed
                 # scaling advanced inside the recorded step ("+nf4+fp8+default": NF4 storage, fp8 compute)
                 "sits+default", "sits+nf4+default", "sits+fp8+default", "sits+nf4+fp8+default",
                 # "+cudnn": cuDNN's attention first in scaled_dot_product_attention's choice
                 "frozen+liger+cudnn", "sits+default+cudnn", "sits+fp8+default+cudnn"]
# Unsloth's LoRA ("unsloth") and QLoRA ("+nf4": its 4-bit load, bitsandbytes NF4), with its gradient checkpointing
# off or ("+gc") in the mode it recommends, use_gradient_checkpointing="unsloth" (offloaded to the host)
UNSLOTH_ARMS = ["unsloth", "unsloth+gc", "unsloth+nf4", "unsloth+nf4+gc"]
OPTIONAL_ARMS += UNSLOTH_ARMS


@contextlib.contextmanager
def liger_patch_undone():
    """build() applies Liger-Kernel to transformers' Llama module for the whole process (arms normally run in
    processes of their own); a script that builds several arms in one process undoes it after each."""
    from transformers.models.llama import modeling_llama

    names = ("LlamaRMSNorm", "LlamaMLP", "apply_rotary_pos_emb")
    saved = {n: getattr(modeling_llama, n) for n in names}
    forward = modeling_llama.LlamaForCausalLM.forward
    try:
        yield
    finally:
        for n, value in saved.items():
            setattr(modeling_llama, n, value)
        modeling_llama.LlamaForCausalLM.forward = forward


def to_bitsandbytes_nf4(model, dtype) -> None:
    """Swap the decoder's projections for bitsandbytes Linear4bit (NF4, double quantization, ``dtype`` compute),
    quantized on the model's device, and mark the model loaded in 4-bit (what PEFT's dispatcher reads)."""
    import bitsandbytes as bnb

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in TARGETS:
                linear = getattr(parent, name, None)
                if linear is None:
                    continue
                # built on the meta device and given the weight, quantized where it lies: a CPU-built layer
                # would first fill a random fp32 weight on the host (about 100 s for the 8B shape's 224 layers)
                quantized = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                              compute_dtype=dtype, quant_type="nf4", compress_statistics=True,
                                              device="meta")
                quantized.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, compress_statistics=True,
                                                     quant_type="nf4", module=quantized).to(linear.weight.device)
                if linear.bias is not None:
                    quantized.bias = linear.bias
                setattr(parent, name, quantized)
    model.is_loaded_in_4bit = True


def llama_config(model_name: str, layers: int = 0):
    """The LlamaConfig of a MODELS shape (``layers``: that many decoder layers, 0 the shape's own count)."""
    from transformers import LlamaConfig

    cfg = dict(MODELS[model_name])
    if layers:
        cfg["num_hidden_layers"] = layers
    rope_theta = cfg.pop("rope_theta")
    config = LlamaConfig(**cfg, max_position_embeddings=8192, attn_implementation="sdpa")
    config.rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    return config


def unsloth_lora_kwargs(arm: str) -> dict:
    """The keyword arguments of ``FastLanguageModel.get_peft_model`` for an Unsloth arm: ``LORA`` and its
    gradient checkpointing ("unsloth" under +gc, else off)."""
    return dict(LORA, bias="none", use_gradient_checkpointing="unsloth" if "gc" in arm.split("+") else False,
                random_state=0)


def local_checkpoint(model_name: str, layers: int, dtype, root: str, device: str = "cpu") -> str:
    """The MODELS shape with the random weights ``build`` makes (seed 0, made on ``device``) saved once as a
    checkpoint folder under ``root``, with a placeholder tokenizer (one token per id), for loaders that read a
    folder; a folder written whole before is reused."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    config = llama_config(model_name, layers)
    folder = os.path.join(root, f"llama-{model_name}-{config.num_hidden_layers}l-{str(dtype).removeprefix('torch.')}")
    if os.path.exists(os.path.join(folder, "complete")):
        return folder
    raw = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(config.vocab_size)}, unk_token="t0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="t0", bos_token="t1", eos_token="t2",
                                        pad_token="t3")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    # named after the weights are made: a pad id at init would zero its embedding row
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = 1, 2, 3
    tmp = folder + ".partial"   # an interrupted write leaves no folder that looks whole
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    open(os.path.join(tmp, "complete"), "w").close()
    del model
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def _unsloth_model(model_name: str, arm: str, dtype, layers: int, seq: int):
    """An Unsloth arm's model and trainable parameters, loaded from ``local_checkpoint``'s folder."""
    from unsloth import FastLanguageModel   # imported first by the worker (unsloth patches transformers on import)

    parts = set(arm.split("+"))
    folder = local_checkpoint(model_name, layers, dtype, os.environ.get("SITS_BENCH_CHECKPOINTS", "/tmp/sits_bench_ckpt"),
                              device="cuda")
    torch.cuda.empty_cache()
    model, _ = FastLanguageModel.from_pretrained(model_name=folder, max_seq_length=seq, dtype=dtype,
                                                 load_in_4bit="nf4" in parts, local_files_only=True,
                                                 use_gradient_checkpointing="unsloth" if "gc" in parts else False)
    model = FastLanguageModel.get_peft_model(model, **unsloth_lora_kwargs(arm))
    model.config.use_cache = False
    with torch.no_grad():  # B = 0 at init; as in build, the benchmark trains with B != 0
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return model, [p for p in model.parameters() if p.requires_grad]


def import_unsloth(arm: str, device: str) -> None:
    """Import unsloth before transformers is imported (its patches need that), or SystemExit with one line."""
    if device != "cuda":
        raise SystemExit(f"arm {arm}: skipped: Unsloth runs on a CUDA GPU only")
    try:
        import unsloth  # noqa: F401
    except ImportError as error:
        raise SystemExit(f"arm {arm}: skipped: unsloth is not installed ({error}); docs/unsloth.md says how to carry "
                         "it to the GPU") from None


def build(model_name: str, arm: str, device: str, dtype, layers: int = 0, seq: int = 2048):
    if arm.startswith("unsloth"):
        return _unsloth_model(model_name, arm, dtype, layers, seq)
    from transformers import LlamaForCausalLM

    config = llama_config(model_name, layers)
    parts = set(arm.split("+"))
    if "liger" in parts or "default" in parts:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        # Liger's fused linear cross-entropy counts the labelled tokens with .item(), a host sync that a CUDA graph
        # cannot record: the +graph arms (and +nolce, which measures what the syncs cost eagerly) keep Liger's
        # RMSNorm, SwiGLU and RoPE and take transformers' loss (the logits materialized: more memory, more GPU time);
        # the default step keeps them too and computes the loss itself
        apply_liger_kernel_to_llama(fused_linear_cross_entropy=not {"graph", "nolce", "default"} & parts)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model.config.use_cache = False
    if "gc" in arm.split("+"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if "nf4" in arm.split("+"):  # QLoRA: the projections as bitsandbytes 4-bit layers, as a 4-bit load gives them
        to_bitsandbytes_nf4(model, dtype)
    if "bnbdq" in arm.split("+"):  # read per call by sits_lora.bases.bnb4 (the worker is this arm's own process)
        os.environ["SITS_LORA_BNB4_DEQUANT"] = "bitsandbytes"
    if arm.startswith("frozen"):
        model.requires_grad_(False)
        model.enable_input_require_grads()
        return model, []
    if arm.startswith("peft"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**LORA))
    else:
        from peft import get_peft_model

        from sits_lora import SitsLoraConfig

        fp8 = {}
        if "fp8" in arm.split("+"):  # fp8 frozen base, "hybrid" recipe (issue 6); emulated on a CPU for --smoke
            fp8 = dict(fp8="hybrid", fp8_emulate=device == "cpu")
        saved = {"recompute_lora_inputs": False} if "saved" in arm.split("+") else {}
        int4 = {"base_quant": "int4"} if "int4" in arm.split("+") else {}
        model = get_peft_model(model, SitsLoraConfig(**LORA, **fp8, **saved, **int4))
    if "gc" in arm.split("+"):
        model.enable_input_require_grads()
    if "offload" in arm.split("+"):
        from sits_lora.activations import enable_offloaded_checkpointing, tile_mlp

        enable_offloaded_checkpointing(model)
        tile_mlp(model)
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():  # B = 0 at init; training has B != 0, and so does the benchmark
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return model, params


def worker(args) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    batch, seq = (args.batch, args.seq) if not args.smoke else (2, 32)
    parts = args.arm.split("+")
    if args.arm.startswith("unsloth"):
        import_unsloth(args.arm, device)
    default = "default" in parts
    if default:  # refused before the model is built: the arm has nothing else to measure
        default_train_step = _default_train_step(args.arm, device)
    model, params = build(args.model, args.arm, device, dtype, args.layers, seq)
    # the whole model as it waits for its first step: weights (4-bit ones packed), LoRA parameters
    weights_gib = torch.cuda.memory_allocated() / 2**30 if device == "cuda" else None
    model.train()
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=device == "cuda") if params else None
    mode = "reduce-overhead" if "cg" in parts else None
    step_model = torch.compile(model, mode=mode) if "compile" in parts else model
    gen = torch.Generator(device=device).manual_seed(1)
    vocab = MODELS[args.model]["vocab_size"]
    ids = torch.randint(0, vocab, (batch, seq), device=device, generator=gen)

    if "cudnn" in parts:
        # "+cudnn": scaled_dot_product_attention tries cuDNN's attention first (flash attention, then the others,
        # where cuDNN refuses a call); the rest of the arm as without it
        from torch.nn.attention import SDPBackend, sdpa_kernel

        sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                     SDPBackend.MATH], set_priority=True).__enter__()
    fp8 = "fp8" in args.arm.split("+")
    if fp8:
        from sits_lora.fp8 import update_scaling

    def step():
        loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if fp8:
            update_scaling(model)  # what SitsHardwareCallback does after each optimizer step
        return loss

    graphed = "graph" in parts
    if graphed:
        if device != "cuda":
            raise SystemExit(f"arm {args.arm}: +graph records CUDA graphs (sits_lora.training.graph_train_step) and "
                             "needs a CUDA GPU")
        from sits_lora.training import graph_train_step

        # two eager steps, then the recording: the timed steps are replays. The batches are unpadded and unpacked:
        # attention recorded causal without the mask transformers builds while a stream captures
        step = graph_train_step(step, optimizer, model=model, assume_causal_attention=True)
    elif default:
        # forward with its own fused linear cross-entropy, backward, clipping, optimizer step and zero_grad, as
        # NativeLoraTrainer runs them on a GPU: recorded as CUDA graphs after warm-up, so it warms up as +graph does
        default_step = default_train_step(model, optimizer, max_grad_norm=1.0)

        def step():
            return default_step(input_ids=ids, labels=ids)
    cuda_graphs = mode == "reduce-overhead" or graphed or default
    t0 = time.perf_counter()
    # each warm-up call's own peak (allocated bytes, reset before the call): for a recorded arm the eager calls, then
    # the call that records, then replays; what a recording holds beyond an eager step shows between them
    warmup_peaks = []
    for _ in range(max(args.warmup, 3) if graphed or default else args.warmup):
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
            warmup_peaks.append(torch.cuda.max_memory_allocated() / 2**30)
    if device == "cuda":
        torch.cuda.synchronize()
        # CUDA graphs allocate their memory pool while warming up and a replay allocates nothing new: their
        # peak counts from the first step, or it would read as if the graphs needed no activation memory
        if not cuda_graphs:
            torch.cuda.reset_peak_memory_stats()
    warmup_s = time.perf_counter() - t0
    times, host_times = [], []
    for _ in range(args.steps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t = time.perf_counter()
            loss = step()
            # the host's time to issue the step: near the GPU step time means the arm is launch-bound
            host_times.append(time.perf_counter() - t)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t = time.perf_counter()
            loss = step()
            times.append(time.perf_counter() - t)
    times.sort()
    step_s = times[len(times) // 2]
    if args.cprofile:
        _write_host_profile(step, device, os.path.join(args.cprofile, f"{args.model}_{args.arm.replace('+', '_')}.txt"))
    if args.kernels and device == "cuda":
        _write_kernel_times(step, os.path.join(args.kernels, f"{args.model}_{args.arm.replace('+', '_')}.json"))
    row = {
        "model": args.model, "arm": args.arm, "layers": args.layers or MODELS[args.model]["num_hidden_layers"],
        "batch": batch, "seq": seq,
        "step_s": step_s, "tokens_per_s": batch * seq / step_s,
        "host_s": sorted(host_times)[len(host_times) // 2] if host_times else None,
        # a graphed arm's peak counts from its first warm-up call (the graphs' pool is made while warming up)
        "peak_gib": (max([torch.cuda.max_memory_allocated() / 2**30] + (warmup_peaks if cuda_graphs else []))
                     if device == "cuda" else None),
        "peak_includes_warmup": cuda_graphs,
        "warmup_peaks_gib": warmup_peaks or None,   # per warm-up call; peak_gib of a graphed arm is their maximum
        "warmup_s": warmup_s, "loss": float(loss), "trainable_params": sum(p.numel() for p in params),
        "weights_gib": weights_gib,
    }
    if params:
        from sits_lora.int4 import int4_weight_memory

        # the adapted projections' frozen weights as stored (4-bit: codes and scales) over their bf16 bytes
        memory = int4_weight_memory(model)
        row["adapted_weight_gib"], row["adapted_weight_ratio"] = memory["stored_bytes"] / 2**30, memory["ratio"]
    if args.arm.startswith("sits"):
        from sits_lora.activations import input_recompute_report

        report = input_recompute_report(model)
        # per adapted layer: did the last timed steps rebuild its input in backward instead of saving it
        row["inputs_rebuilt"] = sum(1 for r in report if r["rebuilt"])
        row["inputs_saved"] = len(report) - row["inputs_rebuilt"] if report else None
    if fp8:
        from sits_lora.fp8 import fp8_layer_plan, fp8_scaling_state, frozen_weight_memory

        memory = frozen_weight_memory(model)
        row["frozen_weight_ratio"] = memory["ratio"]
        # fp8_layers="auto" (the default) quantizes only the layers whose shape pays: say which
        row["fp8_layers"], row["adapted_layers"] = memory["fp8_layers"], memory["layers"]
        shapes = {}
        for entry in fp8_layer_plan(model).values():
            shapes.setdefault(f"{entry['in_features']}x{entry['out_features']}", entry["base"])
        row["fp8_plan"] = shapes
        if memory["fp8_layers"]:
            row.update(fp8_scaling_state(model).log_counts())
    print("RESULT " + json.dumps(row), flush=True)


def _default_train_step(arm: str, device: str):
    """sits_lora.training.default_train_step, or SystemExit with the reason in one line: a package without it yet,
    or a machine without CUDA (Liger's kernels and the step's CUDA graphs)."""
    try:
        from sits_lora.training import default_train_step
    except ImportError:
        raise SystemExit(f"arm {arm}: sits_lora.training has no default_train_step (the step NativeLoraTrainer runs "
                         "by default) in this checkout: nothing to measure") from None
    if device != "cuda":
        raise SystemExit(f"arm {arm}: the default step runs Liger's kernels and records CUDA graphs and needs a "
                         "CUDA GPU")
    return default_train_step


def _write_host_profile(step, device: str, path: str, steps: int = 3) -> None:
    """cProfile over ``steps`` more steps (after the timed ones, so their numbers are untouched): where the host time
    of a step goes, top functions by own time and by cumulative time, per step."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    # on a GPU, backward runs on autograd's device thread, which cProfile does not see: run it on this one
    with torch.autograd.set_multithreading_enabled(False):
        profiler.enable()
        for _ in range(steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    text.write(f"cProfile of {steps} steps (divide by {steps} for one)\n")
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(30)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text.getvalue())


def _write_kernel_times(step, path: str, steps: int = 3) -> None:
    """The GPU time of one step per kernel name (torch.profiler over ``steps`` more steps, after the timed ones):
    where a step's GPU time goes, to set beside another arm's. Kernels replayed from a CUDA graph are counted where
    the profiler sees them (CUPTI traces graph kernels one by one); ``kernel_names`` says how many names it saw."""
    from harness import gpu_kernels_ms

    per_kernel = gpu_kernels_ms(step, steps=steps, warmup=0)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"steps": steps, "gpu_ms_per_step": sum(per_kernel.values()), "kernel_names": len(per_kernel),
                   "per_kernel_ms": per_kernel}, f, indent=1)


def run_arm(model: str, arm: str, *, batch: int = 4, seq: int = 2048, warmup: int = 3, steps: int = 10,
            smoke: bool = False, layers: int = 0, timeout_s: float | None = None, cprofile: str = "",
            kernels: str = "") -> dict:
    """One arm in its own process: its result row, or {"model", "arm", "error"} when it failed. ``cprofile``: a
    folder for the arm's host profile (see --cprofile); ``kernels``: a folder for its GPU time per kernel
    (see --kernels)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--arm", arm, "--model", model,
           "--batch", str(batch), "--seq", str(seq), "--warmup", str(warmup), "--steps", str(steps),
           "--layers", str(layers)]
    if smoke:
        cmd.append("--smoke")
    if cprofile:
        cmd += ["--cprofile", cprofile]
    if kernels:
        cmd += ["--kernels", kernels]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"[{model} {arm}] failed: over its {timeout_s:.0f} s", flush=True)
        return {"model": model, "arm": arm, "error": f"timed out after {timeout_s:.0f} s"}
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"[{model} {arm}] failed: {reason}", flush=True)
        return {"model": model, "arm": arm, "error": reason[-300:]}
    row = json.loads(lines[-1][len("RESULT "):])
    row["wall_s"] = time.perf_counter() - t
    print(f"[{model} {arm}] {row['tokens_per_s']:,.0f} tokens/s, step {row['step_s'] * 1000:.1f} ms, "
          f"host {(row.get('host_s') or 0) * 1000:.1f} ms, peak {row['peak_gib'] or 0:.1f} GiB, wall {row['wall_s']:.0f} s", flush=True)
    return row


def add_floor_ratios(rows: list[dict]) -> None:
    """Each row's step and peak memory against the floor (FLOOR_ARMS) measured in the same run, in place."""
    ok = [r for r in rows if "step_s" in r]
    floors = [r for r in ok if r["arm"] in FLOOR_ARMS]
    floor = min((r["step_s"] for r in floors), default=None)
    floor_mem = min((r["peak_gib"] for r in floors if r.get("peak_gib")), default=None)
    for r in ok:
        r["vs_floor"] = r["step_s"] / floor if floor else None
        r["peak_minus_floor_gib"] = r["peak_gib"] - floor_mem if (floor_mem and r.get("peak_gib")) else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="1b")
    parser.add_argument("--arms", nargs="+", default=ARMS, help=f"from {ARMS + OPTIONAL_ARMS}")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (0: the shape's own count)")
    parser.add_argument("--cprofile", default="", metavar="DIR",
                        help="after the timed steps, profile 3 more with cProfile into DIR/MODEL_ARM.txt (host time)")
    parser.add_argument("--kernels", default="", metavar="DIR",
                        help="after the timed steps, profile 3 more with torch.profiler into DIR/MODEL_ARM.json (GPU "
                             "time per kernel; CUDA only)")
    parser.add_argument("--arm", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    rows = []
    for arm in args.arms:
        rows.append(run_arm(args.model, arm, batch=args.batch, seq=args.seq, warmup=args.warmup, steps=args.steps,
                            smoke=args.smoke, layers=args.layers, cprofile=args.cprofile,
                            kernels=args.kernels))
        _finish(rows, args, argv, final=False)  # a run cut short still leaves its finished arms on disk
    _finish(rows, args, argv, final=True)
    return 0


def _finish(rows, args, argv, final: bool) -> None:
    add_floor_ratios(rows)
    ok = [r for r in rows if "step_s" in r]
    name = f"model_{args.model}" + ("_smoke" if args.smoke else "")
    paths = write_results(name, rows, args.out, {"command": "python bench/bench_model.py " + " ".join(argv or sys.argv[1:])})
    if final:
        print_table(ok, ["model", "arm", "tokens_per_s", "step_s", "vs_floor", "peak_gib", "peak_minus_floor_gib", "warmup_s"])
        if ok:
            _plot(ok, os.path.join(args.out, name + ".png"))
        print("wrote", *paths)


def _plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
    names = [r["arm"] for r in rows]
    ax1.barh(names, [r["tokens_per_s"] for r in rows], color=["#888" if n.startswith("frozen") else "#4a7" if n.startswith("sits") else "#c66" for n in names])
    ax1.set_xlabel("tokens / s (higher is better)")
    ax1.invert_yaxis()
    ax2.barh(names, [r["peak_gib"] or 0 for r in rows], color="#67a")
    ax2.set_xlabel("peak memory, GiB")
    ax2.invert_yaxis()
    fig.suptitle(f"Llama {rows[0]['model']} shape, bs {rows[0]['batch']} x {rows[0]['seq']}, LoRA r16 on 7 projections")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
