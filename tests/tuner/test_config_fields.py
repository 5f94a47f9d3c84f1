"""SitsLoraConfig's own fields: each choice field's Literal type names exactly the values its check accepts, every
field is in the Args docstring with help text, and a config with every field set saves flat and loads equal."""

from __future__ import annotations

import dataclasses
import json
import typing

from peft import LoraConfig

from sits_lora import SitsLoraConfig
from sits_lora.config.adapter import _VALIDATORS

PEFT_FIELDS = {f.name for f in dataclasses.fields(LoraConfig)}
OWN_FIELDS = [f for f in dataclasses.fields(SitsLoraConfig) if f.name not in PEFT_FIELDS]


def test_each_literal_type_is_what_the_check_accepts():
    hints = typing.get_type_hints(SitsLoraConfig)
    literal = {f.name: typing.get_args(hints[f.name]) for f in OWN_FIELDS
               if typing.get_origin(hints[f.name]) is typing.Literal}
    assert {"kernel", "fp8", "rank_scheduler", "base_quant"} <= set(literal)
    for name, values in literal.items():
        check = _VALIDATORS[name]
        assert all(check(v) is None for v in values), name
        assert check("not-a-choice") == f"allowed values are {', '.join(repr(v) for v in values)}", name


def test_every_own_field_is_checked_documented_and_helped():
    doc = SitsLoraConfig.__doc__
    for f in OWN_FIELDS:
        assert f.name in _VALIDATORS, f"{f.name}: no check"
        assert f"\n        {f.name}: " in doc, f"{f.name}: not in the Args docstring"
        assert f.metadata.get("help"), f"{f.name}: no help text"


def test_configs_with_every_field_set_save_flat_and_load_equal(tmp_path):
    common = dict(r=16, target_modules=["q_proj"], kernel="torch", fuse_siblings=False, recompute_lora_inputs=False)
    # dynamic rank, the fp8 base and the 4-bit base exclude each other: three configs cover every field
    dynamic = SitsLoraConfig(**common, use_dynamic_rank=True, rank_scheduler="random", rank_buckets=[8, 16],
                             target_mean_rank=12, rank_histogram=[0.5, 0.5], router_temperature=0.5,
                             rank_budget_step_size=1.0, rank_budget_mode="ceiling")
    fp8 = SitsLoraConfig(**common, fp8="hybrid", fp8_amax_history_len=16, fp8_amax_compute_algo="most_recent",
                         fp8_margin=1, fp8_weight_scale="row", fp8_keep_bf16_weight=True, fp8_emulate=True,
                         fp8_layers="all")
    int4 = SitsLoraConfig(**common, base_quant="int4", int4_group_size=64)
    for index, config in enumerate((dynamic, fp8, int4)):
        folder = str(tmp_path / str(index))
        config.save_pretrained(folder)
        saved = json.loads((tmp_path / str(index) / "adapter_config.json").read_text())
        assert {f.name for f in OWN_FIELDS} <= set(saved)
        assert not any(isinstance(saved[f.name], dict) for f in OWN_FIELDS)   # flat, as PEFT reads it
        loaded = SitsLoraConfig.from_pretrained(folder)
        assert all(getattr(loaded, f.name) == getattr(config, f.name) for f in OWN_FIELDS)


def test_each_feature_declares_its_own_fields():
    """The fields are grouped by feature: a feature's module of sits_lora.config declares its fields (SitsLoraConfig
    inherits them), the config itself only the layer's."""
    from sits_lora.config.dynamic_rank import DynamicRankFields
    from sits_lora.config.fp8 import Fp8Fields
    from sits_lora.config.int4 import Int4Fields

    groups = {cls: {f.name for f in dataclasses.fields(cls)} for cls in (DynamicRankFields, Fp8Fields, Int4Fields)}
    assert all(name.startswith("fp8") for name in groups[Fp8Fields])
    assert groups[Int4Fields] == {"base_quant", "int4_group_size"}
    assert "use_dynamic_rank" in groups[DynamicRankFields] and "rank_buckets" in groups[DynamicRankFields]
    own = {f.name for f in OWN_FIELDS} - set().union(*groups.values())
    assert own == {"kernel", "fuse_siblings", "recompute_lora_inputs"}
