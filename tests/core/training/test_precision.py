"""`training.precision`: bf16 training tracks fp32 on the toy verifier, `auto` follows the hardware, and
master weights and optimizer state stay fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peagle_core.events import CallbackReporter
from peagle_core.model import precision
from peagle_core.training.loop import train
from tests.core.helpers import make_spec

STEPS = 30


def _run(tmp: Path, verifier: Path, data: Path, prepared: Path, mode: str) -> tuple[list[float], list[dict]]:
    spec = make_spec(verifier, data, epochs=3, max_steps=STEPS, precision=mode, checkpoint_every_steps=STEPS)
    metrics, events = [], []
    result = train(
        spec,
        tmp / mode,
        dataset_dir=prepared,
        reporter=CallbackReporter(
            events=lambda e: events.append({"kind": e.kind, **e.data}), metrics=metrics.append
        ),
    )
    assert result.status == "completed"
    for name, p in result.model.named_parameters():
        assert p.dtype == torch.float32, name  # master weights
    return [m["loss"] for m in metrics if "loss" in m and "step" in m], events


def test_bf16_losses_track_fp32_over_tens_of_steps(
    toy_verifier_dir: Path, toy_dataset_path: Path, prepared_dataset: Path, tmp_path: Path
) -> None:
    fp32, fp32_events = _run(tmp_path, toy_verifier_dir, toy_dataset_path, prepared_dataset, "fp32")
    bf16, bf16_events = _run(tmp_path, toy_verifier_dir, toy_dataset_path, prepared_dataset, "bf16")
    assert len(fp32) == len(bf16) == STEPS
    assert [e["precision"] for e in fp32_events if e["kind"] == "precision"] == ["fp32"]
    assert [e["precision"] for e in bf16_events if e["kind"] == "precision"] == ["bf16"]
    # Both learn the same amount...
    assert bf16[-1] < 0.8 * bf16[0] and fp32[-1] < 0.8 * fp32[0]
    # ...along the same trajectory. bf16 keeps 8 significant bits (relative rounding 2^-9 = 0.2% per
    # matmul input), but the loss, its reductions, the gradients' accumulation and the AdamW state are
    # fp32, so the roundings average out: measured, the gap stays under 0.05% of the loss at every one
    # of the 30 steps. 1% leaves 20x room for other CPUs' kernels while a real fault (a gradient lost
    # to bf16, fp32 state downcast, a wrong kernel) moves the loss by more.
    rel = [abs(b - f) / f for b, f in zip(bf16, fp32, strict=True)]
    assert max(rel) < 0.01, [round(r, 4) for r in rel]
    assert bf16 != fp32  # bf16 really ran: the trajectories are not bit-identical


def test_auto_picks_bf16_only_with_fast_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert precision.resolve_precision("fp32", cpu) == "fp32"
    assert precision.resolve_precision("bf16", cpu) == "bf16"
    for flags, want in (({"avx512f"}, "fp32"), ({"avx512f", "avx512_bf16"}, "bf16"), ({"amx_bf16"}, "bf16")):
        monkeypatch.setattr(precision, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert precision.resolve_precision("auto", cpu) == want, flags
    assert precision.resolve_precision("auto", torch.device("cuda")) == "bf16"


def test_this_machine_reports_its_flags() -> None:
    # The choice is read from the CPU's own flags, not assumed: on Linux they are always there.
    flags = precision.cpu_flags()
    assert "fpu" in flags or not Path("/proc/cpuinfo").exists()
    assert precision.has_fast_bf16(torch.device("cpu")) == any(
        f in flags for f in ("amx_bf16", "avx512_bf16")
    )
