"""How hidden-state rows are stored in a cache: bf16, fp8 (e4m3 with a per-row fp32 scale) or fp32, and
what each costs per token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peagle_core.errors import CacheError

DTYPES: tuple[str, ...] = ("bf16", "fp8", "fp32")
STORAGE = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp32": torch.float32}
FP8_MAX = 448.0  # largest finite float8_e4m3fn value


@dataclass
class HiddenRecord:
    """One sample's verifier hidden states, unaligned: `aux [n,3H]` (3 layers concatenated), `last [n,H]`."""

    aux: torch.Tensor
    last: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.aux.shape[0]


# --- codecs --------------------------------------------------------------------------------------


def encode_rows(x: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Encode fp32 rows `[N,D]` for storage; fp8 returns e4m3 values and a per-row fp32 scale `[N]`."""
    x = x.detach().float().cpu().contiguous()
    if dtype == "fp32":
        return x, None
    if dtype == "bf16":
        return x.to(torch.bfloat16), None
    if dtype == "fp8":
        amax = x.abs().amax(dim=-1)
        # An all-zero row would give a zero scale; any positive scale encodes it exactly.
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q, scale
    raise CacheError(f"unknown cache dtype {dtype!r}; use one of {', '.join(DTYPES)}", param="dtype")


def decode_rows(values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Inverse of `encode_rows`, always fp32."""
    x = values.float()
    if scale is not None:
        x = x * scale.float()[:, None]
    return x


def quantize(record: HiddenRecord, dtype: str) -> HiddenRecord:
    """The record as it reads back from a cache of `dtype` (encode then decode)."""
    if dtype == "fp32":
        return HiddenRecord(record.aux.float(), record.last.float())
    return HiddenRecord(
        decode_rows(*encode_rows(record.aux, dtype)), decode_rows(*encode_rows(record.last, dtype))
    )


def bytes_per_token(dtype: str, aux_dim: int, last_dim: int) -> int:
    """Stored bytes per token: hidden rows, fp8 row scales and the int32 token id."""
    if dtype not in STORAGE:
        raise CacheError(f"unknown cache dtype {dtype!r}; use one of {', '.join(DTYPES)}", param="dtype")
    elem = torch.empty((), dtype=STORAGE[dtype]).element_size()
    scales = 2 * 4 if dtype == "fp8" else 0
    return (aux_dim + last_dim) * elem + scales + 4
