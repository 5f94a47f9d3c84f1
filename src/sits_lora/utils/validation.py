"""One validation style for every option a user passes: SitsLoraConfig's fields, their feature rules (dynamic rank,
fp8, 4-bit base), SitsHardwareCallback's arguments, the recipe's numeric options and the public functions' arguments
(:func:`check_arguments`).

A check takes the value and returns None when it is valid, else what is allowed, as the end of a sentence ("it must
be a positive integer, e.g. r=16"); ``validate`` runs a table of them and raises one ValueError that names the
field, the value and that sentence, before any slow work starts. The factories take the rest of the sentence
(``hint``) so each message can say what the value means and give an example. Rules that relate several fields stay
in their feature's config module (``sits_lora.config.fp8.check_fp8_config``, ...). Imports nothing but the standard
library: the config loads it before torch.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional, Sequence

Check = Callable[[Any], Optional[str]]


def is_number(value: Any) -> bool:
    """A finite int or float; True and False are not numbers here."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def is_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int)


def choice(allowed: Sequence[str], hint: str = "") -> Check:
    def check(value: Any) -> Optional[str]:
        return None if value in allowed else f"allowed values are {', '.join(repr(a) for a in allowed)}{hint}"

    return check


def boolean(value: Any) -> Optional[str]:
    return None if isinstance(value, bool) else "it must be True or False"


def _ruled(test: Callable[[Any], bool], sentence: str, hint: str, allow_none: bool) -> Check:
    def check(value: Any) -> Optional[str]:
        if value is None and allow_none:
            return None
        return None if test(value) else sentence + hint

    return check


def positive_int(hint: str = "", allow_none: bool = False) -> Check:
    return _ruled(lambda v: is_int(v) and v > 0, "it must be a positive integer", hint, allow_none)


def non_negative_int(hint: str = "", allow_none: bool = False) -> Check:
    return _ruled(lambda v: is_int(v) and v >= 0, "it must be a non-negative integer", hint, allow_none)


def number(hint: str = "", allow_none: bool = False) -> Check:
    return _ruled(is_number, "it must be a number", hint, allow_none)


def non_negative_number(hint: str = "", allow_none: bool = False) -> Check:
    return _ruled(lambda v: is_number(v) and v >= 0, "it must be a number >= 0", hint, allow_none)


def positive_number(hint: str = "", allow_none: bool = False) -> Check:
    return _ruled(lambda v: is_number(v) and v > 0, "it must be a positive number", hint, allow_none)


def fraction(hint: str = "") -> Check:
    """Strictly between 0 and 1."""
    return _ruled(lambda v: is_number(v) and 0 < v < 1, "it must be a fraction in (0, 1)", hint, False)


def probability(hint: str = "") -> Check:
    """In [0, 1): a dropout probability."""
    return _ruled(lambda v: is_number(v) and 0 <= v < 1, "it must be a probability in [0, 1)", hint, False)


def validate(checks: Mapping[str, Check], value_of: Callable[[str], Any], describe: Callable[[str, Any], str]) -> None:
    """Run each check on ``value_of(name)``; the first problem raises ValueError("<describe> is invalid: <problem>.")."""
    for name, check in checks.items():
        value = value_of(name)
        problem = check(value)
        if problem is not None:
            raise ValueError(f"{describe(name, value)} is invalid: {problem}.")


def check_arguments(caller: str, **arguments: tuple) -> None:
    """A function's arguments, each given as ``name=(value, check)``: the first problem raises
    ValueError("<caller>(<name>=<value>) is invalid: <problem>."), before the function does any work."""
    validate({name: check for name, (_, check) in arguments.items()}, lambda name: arguments[name][0],
             lambda name, value: f"{caller}({name}={value!r})")
