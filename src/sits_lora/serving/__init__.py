"""Serving adapters: several adapters in one batch (``model(..., adapter_names=[...])`` and ``generate`` with
``adapter_names``) on sits_lora's segmented kernels instead of PEFT's loop over adapters (``mixed_batch``), and many
adapters served from a few GPU slots with the rest in pinned host memory (``AdapterPool``), and decode steps
recorded as CUDA graphs and replayed (``graph_decode``); whether a request should merge its adapter or dispatch it
unmerged, from costs measured on the model (``serving_plan``)."""

from .graphs import DecodeGraphs, graph_decode
from .mixed_batch import mixed_batch_forward
from .plan import ServingCosts, ServingPlan, measure_serving_costs, serving_plan
from .pool import AdapterPool

__all__ = ["AdapterPool", "DecodeGraphs", "ServingCosts", "ServingPlan", "graph_decode", "measure_serving_costs",
           "mixed_batch_forward", "serving_plan"]
