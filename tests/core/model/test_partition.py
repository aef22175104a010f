"""Sequence partitioning: segment gradients sum to the unpartitioned step, and activations shrink."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import peagle_core.model.partition as partition
from peagle_core.model.config import PEagleConfig
from peagle_core.model.drafter import PEagleDraftModel
from peagle_core.model.objective import Teacher
from peagle_core.model.partition import partitioned_backward

H, VOCAB = 32, 60


def _model() -> tuple[PEagleDraftModel, Teacher]:
    torch.manual_seed(0)
    cfg = PEagleConfig(
        hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
        vocab_size=VOCAB, draft_vocab_size=VOCAB, num_layers=2, num_depths=4, mask_token_id=VOCAB - 1,
        down_sample_ratio=0.9, down_sample_ratio_min=0.5,
    )  # fmt: skip
    model = PEagleDraftModel(cfg)
    model.set_vocab_map(torch.ones(VOCAB, dtype=torch.bool), torch.zeros(VOCAB, dtype=torch.long))
    return model, Teacher.from_verifier(LlamaRMSNorm(H), torch.randn(VOCAB, H), model.verifier_ids())


def _batch(lengths: tuple[int, ...], pad: int = 3) -> SimpleNamespace:
    g = torch.Generator().manual_seed(1)
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((pad,), -1)])
    t = docs.numel()
    return SimpleNamespace(
        hidden_states=torch.randn(1, t, 3 * H, generator=g),
        input_ids=torch.randint(0, VOCAB - 1, (1, t), generator=g),
        verifier_last_hidden_states=torch.randn(1, t, H, generator=g),
        loss_mask=((torch.rand(t, generator=g) < 0.8).long() * (docs >= 0))[None],
        document_ids=docs[None],
        position_ids=torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(pad, dtype=torch.long)])[
            None
        ],
    )


def _grads(
    model: PEagleDraftModel, teacher: Teacher, batch: SimpleNamespace, segments: int
) -> tuple[dict, dict]:
    model.zero_grad(set_to_none=True)
    metrics = partitioned_backward(
        model, teacher, batch, segments, generator=torch.Generator().manual_seed(7)
    )
    return {n: p.grad.clone() for n, p in model.named_parameters()}, metrics


@pytest.mark.parametrize("segments", [2, 3, 5])
def test_partitioned_gradients_equal_unpartitioned(segments: int) -> None:
    (model, teacher), batch = _model(), _batch((40, 25, 31))
    whole, whole_metrics = _grads(model, teacher, batch, 1)
    parts, part_metrics = _grads(model, teacher, batch, segments)
    for name in whole:
        torch.testing.assert_close(parts[name], whole[name], atol=1e-5, rtol=1e-4, msg=name)
    for key, value in whole_metrics.items():
        torch.testing.assert_close(part_metrics[key].float(), value.float(), atol=1e-5, rtol=1e-5, msg=key)


def _peak_saved_bytes(
    model: PEagleDraftModel, teacher: Teacher, batch: SimpleNamespace, segments: int, monkeypatch
) -> int:
    """Largest total of tensors saved for backward by any one segment (its activation memory)."""
    peak, current = 0, 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal current
        if not isinstance(t, torch.nn.Parameter):
            current += t.numel() * t.element_size()
        return t

    original = partition.distillation_loss

    def counted(*args, **kwargs):
        nonlocal peak, current
        current = 0
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = original(*args, **kwargs)
        peak = max(peak, current)
        return out

    with monkeypatch.context() as patch:
        patch.setattr(partition, "distillation_loss", counted)
        partitioned_backward(model, teacher, batch, segments, generator=torch.Generator().manual_seed(7))
    return peak


def test_activation_memory_falls_with_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    (model, teacher), batch = (
        _model(),
        _batch((60,) * 6, pad=0),
    )  # many documents: each segment needs few keys
    peaks = {s: _peak_saved_bytes(model, teacher, batch, s, monkeypatch) for s in (1, 2, 4)}
    print("peak saved activation bytes per segment count:", peaks)
    assert peaks[2] < 0.7 * peaks[1] and peaks[4] < 0.45 * peaks[1]
