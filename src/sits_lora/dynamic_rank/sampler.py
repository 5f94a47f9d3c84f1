"""TokenEntropySampler: the base model's next-token entropy per token, and the entropy probes.

One batched inference pass of the base model (adapters disabled) over a dataset gives, for every
token, the entropy of the base model's next-token distribution at that position (nats). In the
same pass, each entropy-gated layer's probe is fitted online (Adam on the squared error) to predict
that entropy, standardized, from the layer's input: the router then reads the probe, in training
and at inference alike, and inference needs no extra pass. The result (entropies, probe weights,
probe fit) is cached on disk under a key made of the base model's weights, the tokens of the
dataset and the probe layout, so a second call with the same model and data does no pass.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor, nn

from ..layers.linear import SitsLoraLinear
from ..utils.cache import cache_root
from ..utils import validation
from .router import rms_normalize
from .variant import holds_dynamic_rank

logger = logging.getLogger("sits_lora")

_CACHE_VERSION = 1
# Parameter elements hashed per tensor for the model's fingerprint: 4096 strided samples of each tensor
# tell apart any two checkpoints in practice at the cost of one small strided read per tensor, where hashing
# every weight of an 8B model would take tens of seconds.
_FINGERPRINT_SAMPLES = 4096


def _normalized_name(name: str) -> str:
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


def model_fingerprint(model: nn.Module) -> str:
    """A hash of the base model's weights (adapter weights excluded) and its config."""
    h = hashlib.sha1()
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        h.update(config.to_json_string(use_diff=False).encode())
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    for name in sorted(tensors):
        if "lora_" in name:
            continue
        t = tensors[name].detach()
        flat = t.reshape(-1)
        stride = max(1, flat.numel() // _FINGERPRINT_SAMPLES)
        sample = flat[::stride][:_FINGERPRINT_SAMPLES].float().cpu().numpy()
        h.update(f"{_normalized_name(name)}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(sample.tobytes())
    return h.hexdigest()


def _examples(dataset, tokenizer, max_length: int) -> list[tuple[list, list]]:
    """(input_ids, attention_mask) of every example; "text" examples are tokenized."""
    out = []
    for i in range(len(dataset)):
        row = dataset[i]
        if "input_ids" in row:
            ids = [int(v) for v in (row["input_ids"].tolist() if isinstance(row["input_ids"], Tensor) else row["input_ids"])]
            mask = row.get("attention_mask")
            mask = [int(v) for v in (mask.tolist() if isinstance(mask, Tensor) else mask)] if mask is not None else [1] * len(ids)
        elif "text" in row:
            if tokenizer is None:
                raise ValueError("the dataset has a 'text' column and no 'input_ids': pass the tokenizer to "
                                 "TokenEntropySampler(model, tokenizer)")
            ids = tokenizer(row["text"], truncation=True, max_length=max_length)["input_ids"]
            mask = [1] * len(ids)
        else:
            raise ValueError(f"example {i} has neither 'input_ids' nor 'text' (it has {sorted(row)})")
        if len(ids) > max_length:
            raise ValueError(f"example {i} has {len(ids)} tokens, more than max_length={max_length}; raise max_length "
                             f"or cut the examples (e.g. sits_lora.recipe.data.pack_into_blocks)")
        if not ids:
            raise ValueError(f"example {i} is empty")
        out.append((ids, mask))
    return out


def data_fingerprint(examples: list[tuple[list, list]]) -> str:
    h = hashlib.sha1()
    for ids, mask in examples:
        h.update(np.asarray(ids, dtype=np.int64).tobytes())
        h.update(np.asarray(mask, dtype=np.int8).tobytes())
        h.update(b"|")
    return h.hexdigest()


def token_entropy(logits: Tensor) -> Tensor:
    """(..., V) logits -> (...) entropy of the softmax in nats, computed in fp32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


class TokenEntropySampler:
    """Per-token entropy of the base model over a dataset, in one cached pass; fits the entropy probes.

    ``model``: the model whose base computes the entropies. If it holds entropy-gated dynamic-rank
    layers (a model from ``get_peft_model`` with ``rank_scheduler='entropy-gated'``, or the base model
    it was injected into), their probes are fitted in the same pass. Adapters are disabled during the
    pass, so the entropies are the base model's.

    ``annotate(dataset)`` returns the dataset with a ``token_entropy`` column (one float per token,
    the entropy of the next-token distribution at that position). ``last_cache_hit`` says whether
    the last call read the cache; ``probe_report`` gives each probe's fit (R² on batches it had not
    trained on yet).
    """

    def __init__(self, model: nn.Module, tokenizer: Any = None, *, batch_size: int = 8, max_length: int = 512,
                 cache_dir: Optional[os.PathLike] = None, progress: bool = True, probe_lr: float = 3e-3,
                 probe_steps_per_batch: int = 4, probe_tokens_per_batch: int = 2048, seed: int = 0):
        validation.check_arguments(
            "TokenEntropySampler", batch_size=(batch_size, validation.positive_int()),
            max_length=(max_length, validation.positive_int()),
            probe_steps_per_batch=(probe_steps_per_batch, validation.positive_int()),
            probe_tokens_per_batch=(probe_tokens_per_batch, validation.positive_int()),
            probe_lr=(probe_lr, validation.positive_number()))
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length
        self.cache_dir = Path(cache_dir) if cache_dir is not None else cache_root() / "token_entropy"
        self.progress = progress
        self.probe_lr = probe_lr
        self.probe_steps_per_batch = probe_steps_per_batch
        self.probe_tokens_per_batch = probe_tokens_per_batch
        self.seed = seed
        self.last_cache_hit: Optional[bool] = None
        self.cache_path: Optional[Path] = None
        self.probe_report: dict = {}

    # ------------------------------------------------------------------ public

    def annotate(self, dataset, column: str = "token_entropy"):
        """The dataset with a ``column`` of per-token entropies (a datasets.Dataset or a list of dicts)."""
        values = [e.tolist() for e in self.entropies(dataset)]
        if hasattr(dataset, "add_column"):
            if column in dataset.column_names:
                dataset = dataset.remove_columns(column)
            return dataset.add_column(column, values)
        return [{**dict(dataset[i]), column: values[i]} for i in range(len(dataset))]

    def entropies(self, dataset) -> list[Tensor]:
        """One fp32 tensor per example: the base model's next-token entropy at each position (nats)."""
        examples = _examples(dataset, self.tokenizer, self.max_length)
        probes = self._probe_layers()
        key = self._cache_key(examples, probes)
        self.cache_path = self.cache_dir / f"token_entropy_{key[:20]}.pt"
        if self.cache_path.exists():
            cached = torch.load(self.cache_path, map_location="cpu", weights_only=True)
            for name, layer, adapter in probes:
                layer.lora_entropy_probe[adapter].load_state_dict(cached["probes"][name])
            self.probe_report = cached["probe_report"]
            self.last_cache_hit = True
            self._say(f"token entropy: cache hit, {self.cache_path}")
            return cached["entropies"]
        self.last_cache_hit = False
        self._say(f"token entropy: cache miss, one pass of the base model over {len(examples)} examples "
                  f"({len(probes)} entropy probes to fit)")
        entropies = self._pass(examples, probes)
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.cache_path.with_suffix(".tmp")
        torch.save({
            "version": _CACHE_VERSION,
            "entropies": entropies,
            "probes": {name: {k: v.cpu() for k, v in layer.lora_entropy_probe[adapter].state_dict().items()}
                       for name, layer, adapter in probes},
            "probe_report": self.probe_report,
        }, tmp)
        os.replace(tmp, self.cache_path)  # never leave a half-written cache behind
        return entropies

    # ------------------------------------------------------------------ internals

    def _say(self, message: str) -> None:
        logger.info(message)
        if self.progress:
            print(f"[sits_lora] {message}")

    def _probe_layers(self) -> list[tuple[str, SitsLoraLinear, str]]:
        found = []
        for name, module in self.model.named_modules():
            if holds_dynamic_rank(module):
                for adapter in module.lora_entropy_probe:
                    found.append((f"{_normalized_name(name)}:{adapter}", module, adapter))
        return found

    def _cache_key(self, examples, probes) -> str:
        layout = [(name, int(layer.lora_entropy_probe[adapter].w1.shape[1]), int(layer.lora_entropy_probe[adapter].w1.shape[0]))
                  for name, layer, adapter in probes]
        parts = {
            "version": _CACHE_VERSION,
            "model": model_fingerprint(self.model),
            "data": data_fingerprint(examples),
            "probes": layout,
            "probe_settings": [self.probe_lr, self.probe_steps_per_batch, self.probe_tokens_per_batch, self.seed]
            if probes else None,
        }
        return hashlib.sha1(json.dumps(parts, sort_keys=True).encode()).hexdigest()

    def _pass(self, examples, probes) -> list[Tensor]:
        from peft.tuners.tuners_utils import BaseTunerLayer
        from tqdm.auto import tqdm

        model = self.model
        device = next(model.parameters()).device
        pad_id = getattr(self.tokenizer, "pad_token_id", None) or 0
        gen = torch.Generator().manual_seed(self.seed)
        was_training = model.training
        disabled = {m: m._disable_adapters for m in model.modules() if isinstance(m, BaseTunerLayer)}
        captured: dict[str, Tensor] = {}
        rows: dict[str, Optional[Tensor]] = {"index": None}

        def capture(name):
            def hook(module, args):
                x = args[0]
                captured[name] = x.reshape(-1, x.shape[-1])[rows["index"].to(x.device)].detach()
            return hook

        hooks = [layer.register_forward_pre_hook(capture(name)) for name, layer, _ in probes]
        fits = {name: _ProbeFit(layer.lora_entropy_probe[adapter], self.probe_lr) for name, layer, adapter in probes}
        entropies: list[Tensor] = []
        stats: Optional[tuple[float, float]] = None
        try:
            model.eval()
            for m in disabled:
                m._disable_adapters = True
            starts = range(0, len(examples), self.batch_size)
            for batch_no, start in enumerate(tqdm(starts, desc="token entropy (base model)", disable=not self.progress)):
                batch = examples[start:start + self.batch_size]
                length = max(len(ids) for ids, _ in batch)
                ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
                mask = torch.zeros((len(batch), length), dtype=torch.long)
                for i, (seq, m) in enumerate(batch):
                    ids[i, :len(seq)] = torch.tensor(seq)
                    mask[i, :len(m)] = torch.tensor(m)
                valid = torch.nonzero(mask.reshape(-1), as_tuple=True)[0]                 # (N,)
                pick = valid[torch.randperm(valid.numel(), generator=gen)[:self.probe_tokens_per_batch]]
                rows["index"] = pick
                with torch.no_grad():
                    out = model(input_ids=ids.to(device), attention_mask=mask.to(device))
                    logits = out.logits if hasattr(out, "logits") else out[0]              # (B, S, V)
                    entropy = torch.stack([token_entropy(logits[i]) for i in range(logits.shape[0])]).cpu()  # (B, S)
                for i, (seq, _) in enumerate(batch):
                    entropies.append(entropy[i, :len(seq)].clone())
                if probes:
                    target = entropy.reshape(-1)[pick]                                     # (n,)
                    if stats is None:
                        stats = (float(target.mean()), max(float(target.std()), 1e-3) if target.numel() > 1 else 1.0)
                    z = (target - stats[0]) / stats[1]
                    for name, _, _ in probes:
                        fits[name].update(captured.pop(name), z.to(device), self.probe_steps_per_batch,
                                          evaluate=batch_no > 0)
        finally:
            for hook in hooks:
                hook.remove()
            for m, flag in disabled.items():
                m._disable_adapters = flag
            model.train(was_training)
        report = {}
        for name, layer, adapter in probes:
            probe = layer.lora_entropy_probe[adapter]
            mean, std = stats if stats is not None else (0.0, 1.0)
            probe.entropy_mean.fill_(mean)
            probe.entropy_std.fill_(std)
            probe.fitted.fill_(True)
            report[name] = fits[name].r2()
        finite = [v for v in report.values() if math.isfinite(v)]
        self.probe_report = {"r2_per_layer": report, "r2_mean": float(np.mean(finite)) if finite else float("nan"),
                             "entropy_mean": stats[0] if stats else None, "entropy_std": stats[1] if stats else None}
        return entropies


class _ProbeFit:
    """Online fit of one probe; R² measured on each batch before the probe trains on it."""

    def __init__(self, probe: nn.Module, lr: float):
        self.probe = probe
        self.params = [p for p in probe.parameters()]
        self.optimizer = torch.optim.Adam(self.params, lr=lr)
        self.sq_err = 0.0
        self.sq_dev = 0.0
        self.count = 0
        self.sum = 0.0

    def update(self, x: Tensor, z: Tensor, steps: int, evaluate: bool) -> None:
        x_hat = rms_normalize(x)
        if evaluate:
            with torch.no_grad():
                self.sq_err += float((self.probe(x_hat) - z).pow(2).sum())
                self.sq_dev += float(z.pow(2).sum())
                self.sum += float(z.sum())
                self.count += z.numel()
        for p in self.params:
            p.requires_grad_(True)
        with torch.enable_grad():
            for _ in range(steps):
                loss = (self.probe(x_hat) - z).pow(2).mean()
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
        for p in self.params:
            p.requires_grad_(False)
            p.grad = None

    def r2(self) -> float:
        if self.count < 2:
            return float("nan")
        variance = self.sq_dev - self.sum ** 2 / self.count
        return 1.0 - self.sq_err / variance if variance > 0 else float("nan")
