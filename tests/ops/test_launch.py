"""The direct launcher's specialization key (sits_lora.ops.launch), on the CPU.

The key decides which compiled kernel a call reuses, so it must separate every fact Triton specializes
on (tensor dtype and 16-byte alignment, integers equal to 1 / multiples of 16 / 64-bit, constexpr
values) and the binder written for one call's types must agree with the generic one on every input,
or step aside (raise) when the types change. The GPU side (same bits as Triton's own launch) is
tests/ops/test_launch_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from sits_lora.ops import launch

# a kernel-like signature: two pointers, three ints, a float, two constexprs
CONSTEXPR = [False, False, False, False, False, False, True, True]


def _values(x=None, T=256, stride=2048, s=2.0, block=64, flag=True):
    x = torch.zeros(8, 8) if x is None else x
    return [x, torch.zeros(4, dtype=torch.bfloat16), T, stride, 1, s, block, flag]


def _both(values):
    bind = launch._make_bind(_values(), CONSTEXPR)
    return bind(*values), launch._generic_bind(values, CONSTEXPR)


@pytest.mark.parametrize("values", [
    _values(), _values(T=37), _values(T=1), _values(T=2**33), _values(stride=48), _values(s=0.0),
    _values(block=128), _values(flag=False), _values(x=torch.zeros(9, dtype=torch.float64)[1:]),
], ids=["base", "odd T", "T=1", "64-bit T", "stride 48", "zero scale", "block", "flag", "misaligned"])
def test_bound_key_equals_generic_key(values):
    bound, generic = _both(values)
    assert bound == generic


def test_key_separates_what_triton_specializes_on():
    key = lambda **kw: launch._generic_bind(_values(**kw), CONSTEXPR)[0]  # noqa: E731
    base = key()
    assert key(T=512) == base                       # same class: the compiled kernel is reused
    for other in (key(T=37), key(T=1), key(T=2**33), key(block=128), key(flag=False),
                  key(x=torch.zeros(8, 8, dtype=torch.float16)), key(x=torch.zeros(9)[1:])):
        assert other != base


def test_pointers_are_passed_as_integers():
    values = _values()
    _, launch_values = _both(values)[0]
    assert launch_values[0] == values[0].data_ptr() and launch_values[1] == values[1].data_ptr()
    assert launch_values[2:] == values[2:]


@pytest.mark.parametrize("position,wrong", [(0, 3), (2, torch.zeros(1)), (2, 3.0), (5, 2)],
                         ids=["int for a tensor", "tensor for an int", "float for an int", "int for a float"])
def test_bound_binder_refuses_other_types(position, wrong):
    bind = launch._make_bind(_values(), CONSTEXPR)
    values = _values()
    values[position] = wrong
    with pytest.raises((AttributeError, TypeError)):
        bind(*values)


def test_interpreter_and_switch_turn_the_direct_path_off(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("SITS_LORA_DIRECT_LAUNCH", "0")
    assert not launch.direct_launch_enabled()
    monkeypatch.setenv("SITS_LORA_DIRECT_LAUNCH", "1")
    assert launch.direct_launch_enabled()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not launch.direct_launch_enabled()


def test_hook_chains_count_as_set_only_when_they_hold_a_call():
    class Chain:
        def __init__(self, calls):
            self.calls = calls

    assert not launch._hook_active(None)
    assert not launch._hook_active(Chain([]))
    assert launch._hook_active(Chain([print]))
    assert launch._hook_active(print)  # an older Triton's plain callable
