"""The one conversion of values to plain JSON data, applied to every JSON column on the way in.

JSON has no NaN or Infinity and Postgres JSONB rejects them, so a diverged loss must become null before
any row is written; tensors and NumPy values become numbers or lists. `models.SafeJSON` calls this for
every bound value, so no caller can forget it.
"""

from __future__ import annotations

import math
from typing import Any


def json_safe(value: Any) -> Any:
    """`value` as plain JSON data: tensors and NumPy values become numbers or lists, NaN and infinities
    become null, dict keys become strings, anything else unknown becomes its str."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if hasattr(value, "tolist"):  # torch tensors and NumPy arrays or scalars, 0-d included
        return json_safe(value.tolist())
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, bool | int | str):
        return value
    return str(value)
