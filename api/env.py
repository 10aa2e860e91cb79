"""Numbers read from SLUICE_* environment variables: a malformed one is a ValueError naming the variable."""

from __future__ import annotations

import math
from collections.abc import Callable


def float_setting(name: str, raw: str, valid: Callable[[float], bool], wanted: str) -> float:
    """The number `raw` (the text of variable `name`) if it is finite and `valid`; else ValueError saying `wanted`."""
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and valid(value)):
        raise ValueError(f"{name}={raw!r}: {wanted}")
    return value
