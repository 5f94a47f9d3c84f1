"""Make PEFT know the SITS_LORA peft type, as soon as PEFT is imported and without importing it first.

``register_peft_method`` accepts only a name that is already a member of PEFT's ``PeftType`` enum;
``config/peft_type.py`` adds the member.

When. ``import sits_lora`` stays light (the command line answers ``--help`` and argument errors
before torch, peft and transformers load: they take seconds to import), yet PEFT must know
SITS_LORA before anything loads an adapter. So: if peft is imported already, register at once;
otherwise a finder on ``sys.meta_path`` wraps peft's loader and registers right after peft has
been imported, by whoever imports it. Registering imports sits_lora.config.adapter and sits_lora.model,
which import peft themselves; when peft's first import came from inside one of sits_lora's own
modules (say ``from sits_lora import SitsLoraConfig`` as the first line of a program), that module is
still half built, and registration is retried each time one of sits_lora's modules finishes
importing (the finder wraps those too, until registration succeeds).
"""

from __future__ import annotations

import importlib.abc
import sys

from .config.peft_type import SITS_LORA_NAME, sits_lora_peft_type


def register_with_peft() -> None:
    """Register SitsLoraConfig / SitsLoraModel under SITS_LORA (idempotent)."""
    from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING
    from peft.utils.peft_types import register_peft_method

    from .config.adapter import SitsLoraConfig  # the module itself: while it is half built, the ImportError says so
    from .model import SitsLoraModel, allow_mixed_models

    if PEFT_TYPE_TO_TUNER_MAPPING.get(sits_lora_peft_type()) is SitsLoraModel:
        return
    # prefix "lora_": the parameters keep PEFT LoRA's names (lora_A, lora_B), which is what makes
    # merge, save and the export to a plain LoRA checkpoint work unchanged. Mixed-compatible: a plain
    # SITS_LORA adapter goes into a PeftMixedModel as PEFT's LoRA layer (allow_mixed_models says when).
    register_peft_method(name=SITS_LORA_NAME, config_cls=SitsLoraConfig, model_cls=SitsLoraModel, prefix="lora_",
                         is_mixed_compatible=True)
    allow_mixed_models()


# ----------------------------------------------------------------------------- registration on peft's import

_registered = False
_registering = False


def _try_register() -> None:
    """Register if peft is imported and sits_lora's modules can be; else leave it to the next try."""
    global _registered, _registering
    if _registered or _registering or "peft" not in sys.modules:
        return
    _registering = True
    try:
        register_with_peft()
    except ImportError as error:
        if "partially initialized" not in str(error):
            raise
        return  # a sits_lora module that registration imports is still being imported: retried when it is done
    finally:
        _registering = False
    _registered = True
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _RegisterOnImport)]


class _RegisteringLoader(importlib.abc.Loader):
    """A module's own loader, then a registration attempt once the module is executed."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        _try_register()

    def __getattr__(self, name: str):  # get_source, resource readers, ...: the module's own loader answers
        return getattr(self._inner, name)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Finds peft and sits_lora's submodules through the other finders and wraps their loaders."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "peft" and not fullname.startswith(SITS_LORA_NAME + "."):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


def register_when_peft_loads() -> None:
    """Register now if peft is imported, else as soon as it is (idempotent)."""
    if "peft" in sys.modules:
        _try_register()
    if not _registered and not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
