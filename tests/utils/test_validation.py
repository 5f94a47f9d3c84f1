"""sits_lora.utils.validation: the one style of option checks (a check returns None or what is allowed; validate
raises one ValueError naming the field, the value and that), as SitsLoraConfig and SitsHardwareCallback use it."""

from __future__ import annotations

import math

import pytest

from sits_lora.utils import validation


@pytest.mark.parametrize("check,good,bad", [
    (validation.positive_int(), [1, 64], [0, -1, 1.0, True, None, "2"]),
    (validation.non_negative_int(), [0, 3], [-1, 0.0, False]),
    (validation.number(), [0, -2.5, 3], [math.nan, math.inf, True, "1", None]),
    (validation.positive_number(), [0.1, 7], [0, -1, math.inf, math.nan, True]),
    (validation.non_negative_number(), [0, 2.5], [-0.1, math.nan, math.inf, True, None]),
    (validation.fraction(), [0.5, 1e-9], [0, 1, 1.5, True]),
    (validation.probability(), [0, 0.999], [1, -0.1, False]),
    (validation.boolean, [True, False], [0, 1, "True", None]),
    (validation.choice(("a", "b")), ["a", "b"], ["c", None, "A"]),
])
def test_each_check_accepts_its_values_and_refuses_the_rest(check, good, bad):
    assert all(check(v) is None for v in good)
    assert all(isinstance(check(v), str) and check(v) for v in bad)


def test_none_is_allowed_only_when_asked_and_the_hint_ends_the_sentence():
    assert validation.positive_int(allow_none=True)(None) is None
    assert validation.positive_number(", e.g. x=2")(None) == "it must be a positive number, e.g. x=2"
    assert validation.choice(("off", "on"))("x") == "allowed values are 'off', 'on'"
    assert validation.choice(("off", "on"), " (on: ...)")("x") == "allowed values are 'off', 'on' (on: ...)"


def test_validate_raises_on_the_first_bad_field_in_table_order():
    checks = {"a": validation.positive_int(", e.g. a=1"), "b": validation.boolean}
    values = {"a": 0, "b": "no"}
    with pytest.raises(ValueError) as raised:
        validation.validate(checks, values.__getitem__, lambda name, value: f"Thing({name}={value!r})")
    assert str(raised.value) == "Thing(a=0) is invalid: it must be a positive integer, e.g. a=1."
    validation.validate(checks, {"a": 2, "b": True}.__getitem__, lambda name, value: name)   # no error


def test_check_arguments_names_the_call_and_the_first_bad_argument():
    with pytest.raises(ValueError) as raised:
        validation.check_arguments("plan", steps=(3, validation.positive_int()), images=(0, validation.positive_int()),
                                   mode=("x", validation.choice(("a",))))
    assert str(raised.value) == "plan(images=0) is invalid: it must be a positive integer."
    validation.check_arguments("plan", steps=(3, validation.positive_int()))   # no error
