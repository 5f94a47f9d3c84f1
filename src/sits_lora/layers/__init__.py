"""The adapted layers the features build on: :class:`~sits_lora.layers.linear.SitsLoraLinear` (PEFT's LoRA
``Linear`` on the fused paths, ``linear.py``), :class:`~sits_lora.layers.linear_4bit.SitsLoraLinear4bit` (over a
bitsandbytes 4-bit base; imports bitsandbytes), the sibling groups of layers that read one input
(``siblings.py``) and the checks a quantized base makes of a model before injection (``base_checks.py``).

Imports the kernels, the frozen bases, serving's mixed-batch dispatch and the utilities; never the config's
consumers above it (the features, the tuner model, the tooling). Import the submodules directly.
"""
