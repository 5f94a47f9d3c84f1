"""An adapter pool: many adapters served from a few GPU slots, the rest in pinned host memory.

``AdapterPool(model, capacity=4, max_rank=64)`` adds ``capacity`` slot adapters to a PEFT model (sits_lora's or
PEFT's LoRA), each of rank ``max_rank`` on the layers the model's adapter targets. ``pool.add(name, folder)`` reads
a saved adapter (``save_pretrained``'s folder, or a state dict and its config) into host memory, pinned when a GPU
is there. ``pool.slots_for(names)`` makes every named adapter resident (copying a missing one into the least
recently used slot) and returns the slot names to pass as ``adapter_names``; ``pool.prefetch(name)`` starts that copy
early, on a side stream, so that it overlaps the forward that runs meanwhile::

    pool = AdapterPool(model, capacity=4)
    for name in ("support", "legal", "medical", "chat", "code"):
        pool.add(name, f"out/{name}")
    pool.prefetch("code")                                      # the next request's adapter, while this one runs
    out = model.generate(input_ids=ids, adapter_names=pool.slots_for(["support", "legal", "__base__"]))

An adapter of rank r sits in the first r rows of its slot's A and columns of its B, the rest zero, with the
adapter's own scaling (alpha / r, or alpha / sqrt(r) with rsLoRA) in the slot: outputs are the adapter's. Copies go
on a side stream that waits for the work already queued (which may still read the slot's previous adapter); the
slot's next use waits for the copy. ``pool.stats`` counts hits, loads, evictions and bytes copied.

The stall a swap costs is measured and predicted: ``slots_for`` brackets each wait for a copy with CUDA events on
the current stream, and ``pool.measured_stall_ms()`` sums how long the GPU waited (0 when every copy was prefetched
early enough); ``pool.predicted_stall_ms(name, overlap_ms)`` is the guard rails' PCIe accounting for one adapter: its
bytes over the measured pinned host-to-device bandwidth, less the compute it overlaps.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from collections import OrderedDict
from typing import Optional, Union

import torch
from torch import nn

from ..utils.device_probe import pinned_bandwidth
from ..utils import validation

SLOT_PREFIX = "pool_slot"


class AdapterPool:
    """Adapters in ``capacity`` GPU slots of ``model`` (a PeftModel), the others in host memory (module docstring)."""

    def __init__(self, model: nn.Module, capacity: int = 4, max_rank: int = 64) -> None:
        from peft.tuners.lora import LoraLayer

        validation.check_arguments("AdapterPool", capacity=(capacity, validation.positive_int(" (GPU slots)")),
                                   max_rank=(max_rank, validation.positive_int(" (the slots' rank)")))
        configs = getattr(model, "peft_config", None)
        if not configs:
            raise TypeError("AdapterPool needs a PeftModel with at least one LoRA adapter (get_peft_model(model, "
                            f"SitsLoraConfig(...))), got {type(model).__name__}")
        template = copy.deepcopy(next(iter(configs.values())))
        template.r, template.lora_alpha = max_rank, max_rank     # the slot's own scaling is replaced per adapter
        template.rank_pattern, template.alpha_pattern = {}, {}
        template.lora_dropout = 0.0
        template.use_rslora = False
        self.model, self.capacity, self.max_rank = model, capacity, max_rank
        self.slots = [f"{SLOT_PREFIX}{i}" for i in range(capacity)]
        taken = [s for s in self.slots if s in configs]
        if taken:
            raise ValueError(f"AdapterPool: the model already has adapters named {taken}: one pool per model")
        active = model.active_adapters if hasattr(model, "active_adapters") else None
        for slot in self.slots:
            model.add_adapter(slot, copy.deepcopy(template))
        if active:
            model.set_adapter(active[0] if len(active) == 1 else active)
        # module name (as in a PEFT state dict, "base_model.model....q_proj") -> the LoRA layer holding the slots
        self.layers = {name: m for name, m in model.named_modules()
                       if isinstance(m, LoraLayer) and self.slots[0] in m.lora_A}
        with torch.no_grad():
            for layer in self.layers.values():
                for slot in self.slots:
                    _clear(layer, slot)
        self.device = next(iter(self.layers.values())).lora_A[self.slots[0]].weight.device
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._host: dict[str, dict] = {}                  # name -> {layer name: (A, B, scaling)} in host memory
        self._resident: "OrderedDict[str, str]" = OrderedDict()   # name -> slot, least recently used first
        self._ready: dict[str, Optional[torch.cuda.Event]] = {}   # slot -> the event its copy recorded
        self._last_batch: tuple = ()
        self._waits: list = []                            # (before, after) CUDA events around a wait for a copy
        self._stall_ms = 0.0
        self._bandwidth: Optional[float] = None           # pinned host->device bytes/s, measured on first use
        self.stats = {"hits": 0, "loads": 0, "evictions": 0, "bytes_copied": 0, "prefetch_skipped": 0}

    # ------------------------------------------------------------------ adapters in host memory
    def add(self, name: str, source: Union[str, os.PathLike, dict], config=None) -> None:
        """Read adapter ``name`` into host memory: ``source`` a folder ``save_pretrained`` wrote, or a PEFT state
        dict (keys as ``get_peft_model_state_dict`` gives them) with its ``config`` (a LoraConfig /
        SitsLoraConfig)."""
        if not isinstance(name, str) or not name or name == "__base__" or name.startswith(SLOT_PREFIX):
            raise ValueError(f"AdapterPool.add: {name!r} cannot name an adapter (empty, '__base__' or the pool's "
                             f"'{SLOT_PREFIX}N')")
        if name in self._host:
            raise ValueError(f"AdapterPool.add: {name!r} is in the pool already; pool.remove({name!r}) first")
        if isinstance(source, dict):
            if config is None:
                raise ValueError("AdapterPool.add: a state dict needs its config (config=LoraConfig(...))")
            state = source
        else:
            from peft import PeftConfig
            from peft.utils import load_peft_weights

            if not os.path.isdir(source):
                raise FileNotFoundError(f"AdapterPool.add: {source} is not a folder that save_pretrained wrote")
            config = PeftConfig.from_pretrained(str(source))
            state = load_peft_weights(str(source), device="cpu")
        if getattr(config, "alpha_pattern", None):
            raise ValueError(f"AdapterPool.add: adapter {name!r} sets alpha_pattern, which the pool does not map per "
                             "layer; merge it into lora_alpha per adapter or load it with model.load_adapter")
        pin = torch.cuda.is_available()
        host, unknown = {}, []
        for key, tensor in state.items():
            if not key.endswith(".lora_A.weight"):
                continue
            layer_name = key[: -len(".lora_A.weight")]
            layer = self.layers.get(layer_name) or self.layers.get(f"base_model.model.{layer_name}")
            if layer is None:
                unknown.append(layer_name)
                continue
            A, B = tensor, state[f"{layer_name}.lora_B.weight"]
            r = A.shape[0]
            if r > self.max_rank:
                raise ValueError(f"AdapterPool.add: adapter {name!r} has rank {r} at {layer_name}, above the pool's "
                                 f"max_rank={self.max_rank}; build the pool with max_rank={r} or more")
            scaling = config.lora_alpha / (math.sqrt(r) if getattr(config, "use_rslora", False) else r)
            A = A.detach().to("cpu", layer.lora_A[self.slots[0]].weight.dtype).contiguous()
            B = B.detach().to("cpu", layer.lora_B[self.slots[0]].weight.dtype).contiguous()
            key = layer_name if layer_name in self.layers else f"base_model.model.{layer_name}"
            host[key] = (A.pin_memory() if pin else A, B.pin_memory() if pin else B, scaling)
        if unknown:
            raise ValueError(f"AdapterPool.add: adapter {name!r} adapts {len(unknown)} layer(s) the pool's slots do "
                             f"not cover (e.g. {unknown[0]}); the pool's layers are those of the model's adapter "
                             "when the pool was built")
        if not host:
            raise ValueError(f"AdapterPool.add: {source!r} holds no LoRA weights (no '.lora_A.weight' keys)")
        self._host[name] = host

    def remove(self, name: str) -> None:
        """Forget adapter ``name`` (its slot, if it has one, becomes free)."""
        self._check_known([name])
        slot = self._resident.pop(name, None)
        if slot is not None:
            self._ready.pop(slot, None)
        del self._host[name]

    @property
    def names(self) -> list[str]:
        return list(self._host)

    @property
    def resident(self) -> dict[str, str]:
        """{adapter name: slot} of the adapters on the GPU, least recently used first."""
        return dict(self._resident)

    # ------------------------------------------------------------------ slots
    def prefetch(self, name: str) -> Optional[str]:
        """Start copying adapter ``name`` into a slot (the least recently used one when all are taken) and return
        the slot; a resident adapter only becomes the most recently used. The adapters of the last ``slots_for``
        batch are never evicted here (that batch's forward may not be issued yet): with no other slot to take,
        nothing is copied and None is returned (``stats["prefetch_skipped"]``)."""
        self._check_known([name])
        if name not in self._resident and len(self._resident) == self.capacity and all(
                n in self._last_batch for n in self._resident):
            self.stats["prefetch_skipped"] += 1
            return None
        return self._claim(name, protect=self._last_batch)

    def slots_for(self, names: list[str]) -> list[str]:
        """The slot adapter names for ``names`` (one per sample, "__base__" for none), every one resident when the
        current stream reaches the batch's forward."""
        wanted = list(dict.fromkeys(n for n in names if n != "__base__"))
        self._check_known(wanted)
        if len(wanted) > self.capacity:
            raise ValueError(f"AdapterPool.slots_for: the batch names {len(wanted)} adapters and the pool has "
                             f"{self.capacity} slots; split the batch or build the pool with capacity="
                             f"{len(wanted)} or more")
        slots = {n: self._claim(n, protect=wanted) for n in wanted}
        self._last_batch = tuple(wanted)
        if self._stream is not None:
            current = torch.cuda.current_stream(self.device)
            for slot in slots.values():
                event = self._ready.pop(slot, None)   # once waited for, later work on this stream is after it
                if event is not None:
                    before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    before.record(current)
                    current.wait_event(event)
                    after.record(current)
                    self._waits.append((before, after))
        return [slots.get(n, "__base__") for n in names]

    # ------------------------------------------------------------------ stalls
    def measured_stall_ms(self) -> float:
        """Milliseconds the GPU has waited for adapter copies in ``slots_for`` batches so far (waits until the
        last batch's wait is over; 0.0 on the CPU)."""
        for before, after in self._waits:
            after.synchronize()
            self._stall_ms += before.elapsed_time(after)
        self._waits.clear()
        self.stats["stall_ms"] = self._stall_ms
        return self._stall_ms

    def adapter_bytes(self, name: str) -> int:
        """Bytes one copy of adapter ``name`` moves (its A and B on every layer it adapts)."""
        self._check_known([name])
        return sum(A.numel() * A.element_size() + B.numel() * B.element_size() for A, B, _ in self._host[name].values())

    def predicted_stall_ms(self, name: str, overlap_ms: float = 0.0, bandwidth: Optional[float] = None) -> float:
        """The stall a copy of ``name`` costs when ``overlap_ms`` of compute runs between its prefetch and the batch
        that needs it (0: not prefetched): its bytes over ``bandwidth`` (bytes/s; default the pinned host->device
        bandwidth measured once on this GPU, as the guard rails' PCIe check measures it) less the overlap."""
        validation.check_arguments("AdapterPool.predicted_stall_ms",
                                   overlap_ms=(overlap_ms, validation.non_negative_number(" (milliseconds)")))
        if bandwidth is None:
            if self.device.type != "cuda":
                raise ValueError("AdapterPool.predicted_stall_ms: the pool is on the CPU (no PCIe copy to predict); "
                                 "pass bandwidth= to compute one")
            if self._bandwidth is None:
                self._bandwidth = pinned_bandwidth(self.device, 64 * 2**20, "host->device")[0]
            bandwidth = self._bandwidth
        validation.check_arguments("AdapterPool.predicted_stall_ms",
                                   bandwidth=(bandwidth, validation.positive_number(" (bytes/s)")))
        return max(0.0, self.adapter_bytes(name) / bandwidth * 1e3 - overlap_ms)

    def _claim(self, name: str, protect) -> str:
        if name in self._resident:
            self._resident.move_to_end(name)
            self.stats["hits"] += 1
            return self._resident[name]
        used = set(self._resident.values())
        free = [s for s in self.slots if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next((n for n in self._resident if n not in protect), None)
            if victim is None:   # every resident adapter is in this batch: cannot happen with len <= capacity
                raise RuntimeError("AdapterPool: no slot can be freed for this batch")
            slot = self._resident.pop(victim)
            self.stats["evictions"] += 1
        self._load(name, slot)
        self._resident[name] = slot
        self.stats["loads"] += 1
        return slot

    def _load(self, name: str, slot: str) -> None:
        """Copy ``name``'s weights into ``slot`` (zeros elsewhere) on the side stream, after the queued work."""
        host = self._host[name]
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))   # a forward may still read the old adapter
        copied = 0
        with torch.no_grad(), (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
            for key, layer in self.layers.items():
                entry = host.get(key)
                if entry is None:                      # a layer this adapter does not adapt
                    _clear(layer, slot)
                    continue
                A_slot, B_slot = layer.lora_A[slot].weight, layer.lora_B[slot].weight
                A, B, scaling = entry
                r = A.shape[0]
                A_slot[:r].copy_(A, non_blocking=True)
                A_slot[r:].zero_()
                B_slot[:, :r].copy_(B, non_blocking=True)
                B_slot[:, r:].zero_()
                layer.scaling[slot] = scaling
                copied += A.numel() * A.element_size() + B.numel() * B.element_size()
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            self._ready[slot] = event
        self.stats["bytes_copied"] += copied

    def _check_known(self, names) -> None:
        missing = [n for n in names if n not in self._host]
        if missing:
            raise KeyError(f"AdapterPool: no adapter named {missing[0]!r} in the pool (it holds "
                           f"{sorted(self._host) or 'none'}); pool.add({missing[0]!r}, folder) first")


def _clear(layer, slot: str) -> None:
    """The slot adds nothing on this layer: A, B and the scaling zero."""
    layer.lora_A[slot].weight.zero_()
    layer.lora_B[slot].weight.zero_()
    layer.scaling[slot] = 0.0
