"""Does per-token dynamic rank help? The evaluation behind bench/dynamic_rank_eval.py and notebooks/dynamic_rank.ipynb.

Benchmark code, not part of the installed package: it imports sits_lora like any user, and the
shared bench harness (harness.py next to it) for the environment stamp and the JSON / CSV files.

Protocol (shared/DYNAMIC_RANK.md): every arm fine-tunes the same base model on the same blocks in
the same order for the same number of steps; its learning rate is picked from a small grid by the
loss on validation blocks (held out from the training split) at seed 0, then every seed trains at
that rate; the test blocks (whole held-out modules of the corpus) give the reported loss,
perplexity and the KL divergence KL(p_full-FT || p_arm) of the next-token distributions against a
full fine-tune of the same seed. Arms:

    static-r16        static LoRA at the mean rank (same compute)
    static-r64        static LoRA at r_max (same storage)
    nested-r64@k      one nested adapter (rank_scheduler='static': one bucket per sequence in training), truncated to k
    entropy-gated     router with the entropy probe, r_max at mean rank 16
    learned           the same router without the entropy feature
    random            random buckets with the histogram entropy-gated reached (validation, same seed)
    full-ft           full fine-tuning: the KL reference (and its own loss)

All adapters use rsLoRA scaling alpha/√r at their full rank, so a truncated nested adapter keeps
the scale it was trained with; every LoRA arm runs the PyTorch reference kernel, so numerics do
not differ between arms.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import environment, write_results as write_rows  # noqa: E402

LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ARMS = ("static-r16", "static-r64", "nested-r64", "entropy-gated", "random", "learned")
TINY_MODEL = "tiny-random"


@dataclass
class EvalSettings:
    model: Optional[str] = field(default=None, metadata={
        "help": "loader spec (default SmolLM2-135M); 'tiny-random': a tiny random Llama with a byte tokenizer"})
    seq_len: int = field(default=512, metadata={"help": "tokens per block"})
    batch_size: int = field(default=8, metadata={"help": "blocks per optimizer step"})
    steps: int = field(default=100, metadata={"help": "optimizer steps per run"})
    warmup_fraction: float = field(default=0.1, metadata={"help": "linear warmup, then cosine decay to 0"})
    seeds: tuple = field(default=(0, 1, 2), metadata={"help": "seeds; the learning rate is tuned at the first"})
    lr_grid_lora: tuple = field(default=(5e-4, 1e-3, 2e-3), metadata={"help": "learning rates tried for each adapter arm"})
    lr_grid_full: tuple = field(default=(2e-5, 5e-5, 1e-4), metadata={"help": "learning rates tried for full fine-tuning"})
    lr_by_arm: dict = field(default_factory=dict, metadata={
        "help": "a fixed learning rate for some arms (e.g. the pick of an earlier run's grid), instead of their grid"})
    val_blocks: int = field(default=16, metadata={"help": "validation blocks (from the training split, never trained on)"})
    test_blocks: int = field(default=64, metadata={"help": "test blocks (held-out modules)"})
    eval_batch_size: int = field(default=8, metadata={"help": "blocks per evaluation batch"})
    r_max: int = field(default=64, metadata={"help": "full rank of the dynamic and nested adapters"})
    mean_rank: int = field(default=16, metadata={"help": "target mean rank of the routed arms; rank of the small static arm"})
    buckets: tuple = field(default=(0, 16, 32, 48, 64), metadata={"help": "buckets of the routed arms (0: the token skips the adapter)"})
    nested_buckets: tuple = field(default=(16, 32, 48, 64), metadata={"help": "buckets (and truncations) of the nested arm"})
    lora_alpha: float = field(default=16.0, metadata={"help": "alpha of every adapter (rsLoRA: scale alpha/sqrt(r))"})
    router_temperature: float = field(default=1.0, metadata={"help": "Gumbel-softmax temperature of the routers"})
    rank_budget_step_size: Optional[float] = field(default=None, metadata={
        "help": "dual-ascent step size of the rank budget (default: the library's for the mode: target 0.5, price 6)"})
    router_lr_scale: float = field(default=1.0, metadata={"help": "the routers' learning rate as a multiple of the arm's"})
    rank_budget_mode: str = field(default="price", metadata={
        "help": "'price' (λ shifts the routers' biases: the library's default and the rule of the session-5 "
                "evaluation), 'target' (λ of either sign through the routers' gradient, session 3) or 'ceiling' "
                "(λ ≥ 0, session 2)"})
    target_modules: tuple = field(default=LLAMA_PROJECTIONS, metadata={"help": "adapted projections"})
    arms: tuple = field(default=ARMS, metadata={"help": "arms to run (full-ft always runs: it is the KL reference)"})
    cache_dir: Optional[str] = field(default=None, metadata={
        "help": "token-entropy cache (default: TokenEntropySampler's, under $SITS_LORA_CACHE or ~/.cache/sits_lora)"})
    progress: bool = field(default=True, metadata={"help": "progress bars and one line per run"})

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "steps", "val_blocks", "test_blocks", "eval_batch_size", "r_max", "mean_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"EvalSettings.{name}={value!r} is invalid: it must be a positive integer")
        if not self.seeds:
            raise ValueError("EvalSettings.seeds is empty: give at least one seed (three or more for a mean ± std)")
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown:
            raise ValueError(f"EvalSettings.arms has unknown arms {unknown}; choose from {list(ARMS)}")
        for arm, lr in self.lr_by_arm.items():
            if arm not in ARMS + ("full-ft",):
                raise ValueError(f"EvalSettings.lr_by_arm names an unknown arm {arm!r}; choose from "
                                 f"{list(ARMS) + ['full-ft']}")
            if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
                raise ValueError(f"EvalSettings.lr_by_arm[{arm!r}]={lr!r} is invalid: it must be a positive number")
        if "random" in self.arms and "entropy-gated" not in self.arms:
            raise ValueError("EvalSettings.arms: 'random' uses the histogram of 'entropy-gated'; run both")
        if not self.buckets[-1] == self.nested_buckets[-1] == self.r_max:
            raise ValueError(f"EvalSettings: the last bucket of buckets={self.buckets} and nested_buckets="
                             f"{self.nested_buckets} must equal r_max={self.r_max}")
        if self.mean_rank not in self.nested_buckets:
            raise ValueError(f"EvalSettings: mean_rank={self.mean_rank} must be one of nested_buckets={self.nested_buckets} "
                             f"(the nested arm is truncated to it)")
        self.seeds = tuple(self.seeds)
        self.arms = tuple(self.arms)
        from sits_lora.config.dynamic_rank import DEFAULT_BUDGET_STEP_SIZE

        if self.rank_budget_mode not in DEFAULT_BUDGET_STEP_SIZE:
            raise ValueError(f"EvalSettings.rank_budget_mode={self.rank_budget_mode!r} is invalid: allowed values are "
                             f"{', '.join(map(repr, DEFAULT_BUDGET_STEP_SIZE))}")
        if self.rank_budget_step_size is None:  # recorded as the number the runs used
            self.rank_budget_step_size = DEFAULT_BUDGET_STEP_SIZE[self.rank_budget_mode]


PRESETS = {
    # the notebook under test and the CPU tests: a tiny random Llama, seconds
    "tiny": dict(model=TINY_MODEL, seq_len=32, batch_size=2, steps=3, seeds=(0, 1), lr_grid_lora=(3e-3,),
                 lr_grid_full=(1e-3,), val_blocks=2, test_blocks=2, eval_batch_size=2),
    # the real model on a CPU, every arm, one seed: 2 min 56 s measured on this project's shared 2-core CPU
    # (the model load is 25 s of it; the full fine-tune's AdamW over 135 M weights most of the rest)
    "smoke": dict(seq_len=32, batch_size=2, steps=2, seeds=(0,), lr_grid_lora=(1e-3,), lr_grid_full=(5e-5,),
                  val_blocks=1, test_blocks=2, eval_batch_size=2),
    # one H200, measured (2026-11-30-h200-session2): 35 runs of 80 steps of 8 x 512 tokens take about 18 minutes,
    # more than one 10-minute GPU call: full fine-tune 9-14 s a run, static / nested LoRA 15-22 s (the PyTorch
    # reference kernel in fp32 under bf16 autocast, launch-bound at this width), routed arms 24-41 s, the entropy
    # pass 56 s (cached on disk after). Split the arms over two calls (--arms) and merge with --merge-partials.
    "budget": dict(seq_len=512, batch_size=8, steps=80, seeds=(0, 1, 2), lr_grid_full=(3e-5, 1e-4), val_blocks=16,
                   test_blocks=64),
}


def settings_for(size: str, **overrides) -> EvalSettings:
    if size not in PRESETS:
        raise ValueError(f"size={size!r} is invalid: allowed values are {', '.join(map(repr, PRESETS))}")
    kwargs = dict(PRESETS[size])
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    return EvalSettings(**kwargs)


# ---------------------------------------------------------------------------------------------- model and data


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0-255), EOS = 256: the tiny model's tokenizer, nothing to download."""

    eos_token_id = 256
    pad_token_id = 256
    vocab_size = 257

    def __call__(self, text: str, add_special_tokens: bool = False, truncation: bool = False, max_length: Optional[int] = None):
        ids = list(text.encode("utf-8"))
        if truncation and max_length is not None:
            ids = ids[:max_length]
        return {"input_ids": ids}


def load_eval_model(spec: Optional[str], seq_len: int):
    """(model in fp32, tokenizer, description) for a settings.model value."""
    if spec == TINY_MODEL:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(1234)
        # d = 64 with 4 key-value heads: every projection has both dims >= 64 = r_max
        config = LlamaConfig(vocab_size=ByteTokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                             max_position_embeddings=max(seq_len, 128), tie_word_embeddings=False)
        return LlamaForCausalLM(config), ByteTokenizer(), "tiny random Llama (1 layer, d=64), byte tokenizer"
    from sits_lora.recipe.loading import load_model_and_tokenizer

    model, tokenizer, source = load_model_and_tokenizer(spec, dtype=torch.float32)
    return model, tokenizer, source.describe()


def pack_blocks(texts, tokenizer, seq_len: int, max_blocks: int) -> torch.Tensor:
    """(N, seq_len) int64: the texts tokenized, joined with EOS, cut into blocks (as sits_lora.recipe.data.pack_into_blocks)."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
        if len(ids) >= seq_len * max_blocks:
            break
    n = min(len(ids) // seq_len, max_blocks)
    return torch.tensor(ids[:n * seq_len], dtype=torch.long).reshape(n, seq_len)


def load_blocks(tokenizer, settings: EvalSettings):
    """(train, validation, test) (N, seq_len) token blocks: train and validation from the training modules of the
    standard-library corpus, test from its held-out modules (sits_lora.recipe.data's corpus and split).

    Reads the corpus file directly instead of through ``datasets`` (which the GPU image lacks).
    """
    from sits_lora.recipe.data import build_stdlib_corpus

    train_text, heldout_text = [], []
    with open(build_stdlib_corpus()) as f:
        for line in f:
            record = json.loads(line)
            (heldout_text if record["split"] == "heldout" else train_text).append(record["text"])
    n_train = settings.steps * settings.batch_size
    blocks = pack_blocks(train_text, tokenizer, settings.seq_len, n_train + settings.val_blocks)
    if len(blocks) < settings.val_blocks + settings.batch_size:
        raise ValueError(f"the training split gives {len(blocks)} blocks of {settings.seq_len} tokens, too few for "
                         f"{settings.val_blocks} validation blocks and one batch of {settings.batch_size}")
    test = pack_blocks(heldout_text, tokenizer, settings.seq_len, settings.test_blocks)
    return blocks[:-settings.val_blocks], blocks[-settings.val_blocks:], test


# ---------------------------------------------------------------------------------------------- arms


def arm_config(arm: str, settings: EvalSettings, histogram: Optional[list] = None):
    from sits_lora import SitsLoraConfig

    common = dict(lora_alpha=settings.lora_alpha, use_rslora=True, target_modules=list(settings.target_modules),
                  kernel="torch", task_type="CAUSAL_LM")
    dynamic = dict(r=settings.r_max, use_dynamic_rank=True, rank_buckets=list(settings.buckets),
                   router_temperature=settings.router_temperature, rank_budget_step_size=settings.rank_budget_step_size,
                   rank_budget_mode=settings.rank_budget_mode)
    if arm == "static-r16":
        return SitsLoraConfig(r=settings.mean_rank, **common)
    if arm == "static-r64":
        return SitsLoraConfig(r=settings.r_max, **common)
    if arm == "nested-r64":
        return SitsLoraConfig(r=settings.r_max, use_dynamic_rank=True, rank_scheduler="static",
                              rank_buckets=list(settings.nested_buckets), **common)
    if arm in ("entropy-gated", "learned"):
        return SitsLoraConfig(rank_scheduler=arm, target_mean_rank=settings.mean_rank, **dynamic, **common)
    if arm == "random":
        return SitsLoraConfig(rank_scheduler="random", rank_histogram=list(histogram), **dynamic, **common)
    raise ValueError(f"unknown arm {arm!r}")


def _lr_lambda(steps: int, warmup_fraction: float) -> Callable[[int], float]:
    warmup = max(1, int(round(steps * warmup_fraction)))

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def train_model(model, train_blocks, settings: EvalSettings, lr: float, seed: int, budget=None,
                after_step: Optional[Callable[[], None]] = None) -> dict:
    """Train the trainable parameters of ``model`` for settings.steps AdamW steps; return timings and the budget trace.

    ``after_step`` runs after each optimizer step (bench/fp8_quality.py advances the fp8 scales there)."""
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    router = [p for n, p in model.named_parameters() if p.requires_grad and "lora_router" in n]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and "lora_router" not in n]
    groups = [{"params": rest}] + ([{"params": router, "lr": lr * settings.router_lr_scale}] if router else [])
    optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(settings.steps, settings.warmup_fraction))
    order_gen = torch.Generator().manual_seed(seed)  # the data order depends on the seed only: the same for every arm
    n = len(train_blocks)
    order: list[int] = []
    torch.manual_seed(seed)
    model.train()
    trace = []
    losses = []   # device tensors, read once at the end (a read per step would wait for the GPU)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for step in range(settings.steps):
        while len(order) < settings.batch_size:
            order.extend(torch.randperm(n, generator=order_gen).tolist())
        batch, order = order[:settings.batch_size], order[settings.batch_size:]
        ids = train_blocks[batch].to(device)                                             # (B, S)
        with _autocast(device):
            loss = model(input_ids=ids, labels=ids).loss
        losses.append(loss.detach())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step()
        if budget is not None:
            stats = budget.step()
            trace.append({"mean_active_rank": stats["mean_active_rank"], "lambda": stats["lambda"]})
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    model.eval()
    return {"train_seconds": seconds, "final_train_loss": loss.item(), "budget_trace": trace,
            "train_losses": [float(v) for v in losses]}


@torch.no_grad()
def evaluate_model(model, blocks, settings: EvalSettings, reference=None, budget=None, seed: int = 0) -> dict:
    """Mean next-token loss, perplexity, KL(reference || model) per token, and the rank statistics."""
    device = next(model.parameters()).device
    model.eval()
    if budget is not None:
        budget.read_stats(reset=True)
    torch.manual_seed(seed)  # the random arm draws its buckets at evaluation too
    total_loss, total_kl, tokens = 0.0, 0.0, 0
    # evaluation forwards count in the rank statistics only when asked: they are not training steps
    with budget.measuring() if budget is not None else contextlib.nullcontext():
        for start in range(0, len(blocks), settings.eval_batch_size):
            ids = blocks[start:start + settings.eval_batch_size].to(device)              # (B, S)
            with _autocast(device):
                logits = model(input_ids=ids).logits[:, :-1]
            logp = torch.log_softmax(logits.float(), -1)                                    # (B, S-1, V)
            targets = ids[:, 1:]
            total_loss += float(-logp.gather(-1, targets.unsqueeze(-1)).sum())
            if reference is not None:
                with _autocast(device):
                    ref_logits = reference(input_ids=ids).logits[:, :-1]
                ref_logp = torch.log_softmax(ref_logits.float(), -1)
                total_kl += float((ref_logp.exp() * (ref_logp - logp)).sum())
            tokens += targets.numel()
    loss = total_loss / tokens
    out = {"loss": loss, "ppl": math.exp(loss), "tokens": tokens}
    if reference is not None:
        out["kl_vs_full_ft"] = total_kl / tokens
    if budget is not None:
        stats = budget.read_stats(reset=True)
        out["active_rank"] = stats["mean_active_rank"]
        out["histogram"] = stats["histogram"]
        out["layer_mean_rank"] = stats["layer_mean_rank"]
    return out


# ---------------------------------------------------------------------------------------------- the evaluation


def _say(settings: EvalSettings, message: str) -> None:
    if settings.progress:
        print(f"[dynamic-rank eval] {message}", flush=True)


def _evaluate_run(arm: str, model, budget, settings: EvalSettings, val_blocks, test_blocks, reference, seed: int) -> list[dict]:
    """The test (and validation) results of one trained model: one entry, or one per truncation for the nested arm."""
    from sits_lora import truncate_rank

    if arm == "nested-r64":
        entries = []
        for k in settings.nested_buckets:
            # a truncated adapter is static, so each truncation starts from a copy of the nested one
            truncated = truncate_rank(copy.deepcopy(model), k) if k != settings.r_max else model
            test = evaluate_model(truncated, test_blocks, settings, reference=reference, seed=seed)
            entry = {"arm": f"nested-r64@{k}", "active_rank": float(k), "test_loss": test["loss"],
                     "test_ppl": test["ppl"], "kl_vs_full_ft": test.get("kl_vs_full_ft")}
            if k == settings.mean_rank:  # the arm is "nested r_max truncated to the mean rank": tuned there
                val_loss = evaluate_model(truncated, val_blocks, settings, seed=seed)["loss"]
            entries.append(entry)
            del truncated
        for entry in entries:
            entry["val_loss"] = val_loss
        return entries
    val = evaluate_model(model, val_blocks, settings, budget=budget, seed=seed)
    test = evaluate_model(model, test_blocks, settings, reference=reference, budget=budget, seed=seed)
    entry = {"arm": arm, "val_loss": val["loss"], "test_loss": test["loss"], "test_ppl": test["ppl"],
             "kl_vs_full_ft": test.get("kl_vs_full_ft")}
    if budget is not None:
        # per layer: does the router move rank between layers, between tokens, or both?
        entry.update({"active_rank": test["active_rank"], "val_histogram": val["histogram"],
                      "test_histogram": test["histogram"], "test_layer_mean_rank": test["layer_mean_rank"]})
    elif arm == "full-ft":
        entry["active_rank"] = None
    else:
        entry["active_rank"] = float(model.peft_config["default"].r)
    return [entry]


def run_evaluation(settings: EvalSettings, out_dir: Optional[str] = None) -> dict:
    """Run every arm; return the results (and write them to out_dir when given)."""
    from peft import get_peft_model

    from sits_lora.dynamic_rank import RankBudget, TokenEntropySampler, rank_parameter_counts
    from sits_lora.dynamic_rank.budget import dynamic_rank_layers

    t0 = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base, tokenizer, description = load_eval_model(settings.model, settings.seq_len)
    base.to(device).eval()
    base.requires_grad_(False)
    train_blocks, val_blocks, test_blocks = load_blocks(tokenizer, settings)
    n_runs = (len(settings.arms) + 1) * (max(len(settings.lr_grid_lora), len(settings.lr_grid_full)) + len(settings.seeds) - 1)
    _say(settings, f"model: {description}; {len(train_blocks)} train / {len(val_blocks)} validation / "
                   f"{len(test_blocks)} test blocks of {settings.seq_len} tokens; device {device}; "
                   f"about {n_runs} runs of {settings.steps} steps")
    info: dict = {"probe_report": None, "parameter_counts": {}, "sampler_cache_hits": []}
    references: dict[int, torch.nn.Module] = {}
    histograms: dict[int, list] = {}
    runs: list[dict] = []
    tuning: list[dict] = []

    def one_run(arm: str, seed: int, lr: float) -> list[dict]:
        torch.manual_seed(seed)
        budget = None
        if arm == "full-ft":
            model = copy.deepcopy(base)
            model.requires_grad_(True)
        else:
            histogram = histograms[seed] if arm == "random" else None
            model = get_peft_model(copy.deepcopy(base), arm_config(arm, settings, histogram))
            if dynamic_rank_layers(model) and arm != "nested-r64":
                budget = RankBudget(model)
            if arm == "entropy-gated":
                sampler = TokenEntropySampler(model, tokenizer, batch_size=settings.eval_batch_size,
                                              max_length=settings.seq_len, cache_dir=settings.cache_dir,
                                              progress=settings.progress)
                sampler.entropies([{"input_ids": row} for row in train_blocks])
                info["sampler_cache_hits"].append(sampler.last_cache_hit)
                info["probe_report"] = sampler.probe_report
            info["parameter_counts"][arm] = {**rank_parameter_counts(model),
                                             "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}
        timing = train_model(model, train_blocks, settings, lr, seed, budget)
        entries = _evaluate_run(arm, model, budget, settings, val_blocks, test_blocks, references.get(seed), seed)
        if arm == "full-ft":
            references[seed] = model
            entries[0]["kl_vs_full_ft"] = 0.0
        for entry in entries:
            entry.update({"seed": seed, "lr": lr, "train_seconds": timing["train_seconds"],
                          "final_train_loss": timing["final_train_loss"]})
            if timing["budget_trace"]:
                last = timing["budget_trace"][-10:]
                entry["train_active_rank_last10"] = sum(t["mean_active_rank"] for t in last) / len(last)
                entry["final_lambda"] = last[-1]["lambda"]
                entry["budget_trace"] = {key: [round(t[key], 4) for t in timing["budget_trace"]]
                                         for key in ("mean_active_rank", "lambda")}
        return entries

    def checkpoint() -> None:
        # a run cut short (the GPU session's 10-minute limit) still leaves every finished run on disk
        if out_dir is not None:
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, "dynamic_rank_eval_partial.json"), "w") as f:
                json.dump({"environment": environment(), "model": description, "settings": dataclasses.asdict(settings),
                           "runs": runs, "tuning": tuning, "seconds": time.perf_counter() - t0}, f, default=str)

    order = ["full-ft"] + [a for a in ARMS if a in settings.arms]  # full-ft first (the KL reference), random after entropy-gated
    for arm in order:
        grid = settings.lr_grid_full if arm == "full-ft" else settings.lr_grid_lora
        if arm in settings.lr_by_arm:
            grid = (float(settings.lr_by_arm[arm]),)
        first = settings.seeds[0]
        candidates = []
        for lr in grid:
            if arm == "full-ft" and first in references:
                del references[first]  # keep only the chosen rate's model as the reference
            entries = one_run(arm, first, lr)
            candidates.append((entries[-1]["val_loss"], lr, entries, references.get(first) if arm == "full-ft" else None))
            tuning.extend(entries)
            _say(settings, f"{arm:>14} seed {first} lr {lr:g}: validation loss {entries[-1]['val_loss']:.4f}, "
                           f"{entries[-1]['train_seconds']:.1f} s")
            checkpoint()
        _, best_lr, best_entries, best_reference = min(candidates, key=lambda c: c[0])
        if arm == "full-ft":
            references[first] = best_reference
        runs.extend(best_entries)
        checkpoint()
        if arm == "entropy-gated":
            histograms[first] = [best_entries[0]["val_histogram"][int(b)] for b in settings.buckets]
        for seed in settings.seeds[1:]:
            entries = one_run(arm, seed, best_lr)
            runs.extend(entries)
            if arm == "entropy-gated":
                histograms[seed] = [entries[0]["val_histogram"][int(b)] for b in settings.buckets]
            _say(settings, f"{arm:>14} seed {seed} lr {best_lr:g}: validation loss {entries[-1]['val_loss']:.4f}")
            checkpoint()
    base_eval = [evaluate_model(base, test_blocks, settings, reference=references[s], seed=s) for s in settings.seeds]
    results = {
        "settings": dataclasses.asdict(settings),
        "environment": environment(),
        "model": description,
        "base": {"test_loss": base_eval[0]["loss"], "test_ppl": base_eval[0]["ppl"],
                 "kl_vs_full_ft": sum(e["kl_vs_full_ft"] for e in base_eval) / len(base_eval)},
        "rows": summarize(runs),
        "runs": runs,
        "tuning": tuning,
        "router": info,
        "wall_seconds": time.perf_counter() - t0,
    }
    if out_dir is not None:
        write_results(results, out_dir)
    return results


# ---------------------------------------------------------------------------------------------- reporting


def _mean_std(values: list) -> tuple[Optional[float], Optional[float]]:
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None  # one seed has no spread
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def summarize(runs: list[dict]) -> list[dict]:
    """One row per arm: mean ± sample std over seeds of test loss, perplexity, KL and active rank."""
    rows = []
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm]
        row = {"arm": arm, "seeds": len(mine), "lr": mine[0]["lr"]}
        for key in ("test_loss", "test_ppl", "kl_vs_full_ft", "active_rank"):
            row[f"{key}_mean"], row[f"{key}_std"] = _mean_std([r.get(key) for r in mine])
        rows.append(row)
    return rows


def results_from_partials(paths: list[str], settings: EvalSettings, environment_from: Optional[str] = None) -> dict:
    """One result from the partial files of runs cut short (each GPU call has a 10-minute limit).

    Each (arm, seed) run comes from the first file that has it, so a call cut after an arm's second
    seed can be finished by a later call that runs only the missing seed. Every call repeats full-ft
    (its KL reference, same seeds and rates) and its arms' KL is measured against that call's own
    full-ft. An arm's seeds taken from different files must share one learning rate (else ValueError).
    ``environment_from``: a result file written on the same machine in the same session, for partial
    files older than the environment stamp they now carry.
    """
    runs: list[dict] = []
    tuning: list[dict] = []
    run_source: dict = {}  # (arm, seed) -> file
    arm_rate: dict = {}  # arm -> (lr, file)
    tuned: set = set()
    environment_stamp, model = None, settings.model
    for path in paths:
        with open(path) as f:
            part = json.load(f)
        environment_stamp = environment_stamp or part.get("environment")
        model = part.get("model", model)
        for run in part["runs"]:
            key = (run["arm"], run["seed"])
            if key in run_source:
                continue
            lr, first_path = arm_rate.setdefault(run["arm"], (run["lr"], path))
            if not math.isclose(run["lr"], lr):
                raise ValueError(f"--merge-partials: arm {run['arm']!r} ran at lr {lr:g} in {first_path} and at "
                                 f"lr {run['lr']:g} in {path} (seed {run['seed']}); merge only runs of one rate "
                                 f"per arm (rerun the missing seeds with --lr {run['arm']}={lr:g})")
            run_source[key] = path
            runs.append(run)
        for entry in part["tuning"]:
            key = (entry["arm"], entry["seed"], entry["lr"])
            if key not in tuned:
                tuned.add(key)
                tuning.append(entry)
    if environment_from is not None:
        with open(environment_from) as f:
            environment_stamp = json.load(f)["environment"]
    return {"settings": dataclasses.asdict(settings), "environment": environment_stamp or environment(),
            "model": model or "SmolLM2-135M-Instruct", "merged_from": list(paths), "rows": summarize(runs),
            "runs": runs, "tuning": tuning}


def plot_loss_vs_rank(results: dict, path: Optional[str] = None):
    """Left: test loss (mean ± std over seeds) against mean active rank, the nested truncations as a line.
    Right: the arms near the target mean rank side by side on a scale that resolves them (a nested
    adapter at full rank can sit 0.25 nats higher and flatten the left panel), with each arm's KL."""
    from matplotlib.figure import Figure  # not pyplot: no global backend state, works headless and in notebooks

    rows = {r["arm"]: r for r in results["rows"]}
    fig = Figure(figsize=(11.5, 4.4))
    ax, near = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.1, 1.0]})
    nested = sorted((r for a, r in rows.items() if a.startswith("nested-r64@")), key=lambda r: r["active_rank_mean"])
    if nested:
        ax.errorbar([r["active_rank_mean"] for r in nested], [r["test_loss_mean"] for r in nested],
                    yerr=[r["test_loss_std"] or 0.0 for r in nested], marker="o", linestyle="-", capsize=3,
                    color="C0", label="nested r=64, truncated to k")
    markers = {"static-r16": "s", "static-r64": "s", "entropy-gated": "*", "learned": "^", "random": "x"}
    colors = {arm: f"C{i + 1}" for i, arm in enumerate(markers)}  # one colour per arm in both panels
    for arm, marker in markers.items():
        if arm in rows:
            r = rows[arm]
            ax.errorbar([r["active_rank_mean"]], [r["test_loss_mean"]], yerr=[r["test_loss_std"] or 0.0],
                        xerr=[r["active_rank_std"] or 0.0], marker=marker, markersize=9, capsize=3, linestyle="none",
                        color=colors[arm], label=arm)
    if "full-ft" in rows:
        for axis in (ax, near):
            axis.axhline(rows["full-ft"]["test_loss_mean"], color="gray", linestyle="--", label="full fine-tune")
    ax.set_xlabel("mean active rank (test tokens)")
    ax.set_ylabel("held-out loss (nats / token)")
    env = results["environment"]
    seeds = len(results["settings"]["seeds"])
    ax.set_title(f"{os.path.basename(results['model'])[:60]}\n{results['settings']['steps']} steps, {seeds} "
                 f"seed{'s' if seeds > 1 else ''}, {env['gpu'] or env['cpu']}", fontsize=9)
    ax.legend(fontsize=8)

    # the right panel: every adapter arm within 25 % of the target mean rank, and static r_max for scale
    target = results["settings"]["mean_rank"]
    close = [a for a, r in rows.items() if a != "full-ft" and r["active_rank_mean"] is not None
             and (abs(r["active_rank_mean"] - target) <= 0.25 * target or a == "static-r64")]
    close.sort(key=lambda a: rows[a]["test_loss_mean"])
    for i, arm in enumerate(close):
        r = rows[arm]
        near.errorbar([i], [r["test_loss_mean"]], yerr=[r["test_loss_std"] or 0.0], marker=markers.get(arm, "o"),
                      markersize=9, capsize=4, linestyle="none", color=colors.get(arm, "C0"))
    kl = [rows[a]["kl_vs_full_ft_mean"] for a in close]
    near.set_xticks(range(len(close)), [f"{a}\nrank {rows[a]['active_rank_mean']:.1f}"
                                        + (f"\nKL {k:.3f}" if k is not None else "") for a, k in zip(close, kl)],
                    fontsize=7)
    near.set_xlim(-0.6, len(close) - 0.4)
    near.set_title(f"arms near mean rank {target} (and r = {results['settings']['r_max']}), best first", fontsize=9)
    near.set_ylabel("held-out loss (nats / token)")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


_RUN_COLUMNS = ["arm", "seed", "lr", "active_rank", "val_loss", "test_loss", "test_ppl", "kl_vs_full_ft",
                "train_seconds", "final_train_loss", "train_active_rank_last10", "final_lambda"]


def write_results(results: dict, out_dir: str) -> dict:
    """dynamic_rank_eval.json (everything) and .csv (one row per arm) through the bench harness,
    dynamic_rank_eval_runs.csv (one row per run) and dynamic_rank_eval.png in out_dir."""
    extra = {k: v for k, v in results.items() if k != "rows"}  # its "environment" replaces the one the harness would stamp
    json_path, csv_path = write_rows("dynamic_rank_eval", results["rows"], out_dir, extra=extra)
    paths = {"json": json_path, "csv": csv_path, "runs_csv": os.path.join(out_dir, "dynamic_rank_eval_runs.csv"),
             "png": os.path.join(out_dir, "dynamic_rank_eval.png")}
    with open(paths["runs_csv"], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(_RUN_COLUMNS)
        for run in results["runs"]:
            writer.writerow([run.get(c) for c in _RUN_COLUMNS])
    try:
        plot_loss_vs_rank(results, paths["png"])
    except ImportError as error:  # the JSON and CSV files are written already; the plot can be made from the JSON
        print(f"[dynamic-rank eval] no PNG ({error}); install matplotlib and run "
              f"plot_loss_vs_rank(json.load(open({paths['json']!r})), 'plot.png')")
        paths["png"] = None
    return paths
