"""The loss options (`training.depth_weights`, `tv_weight`, `in_vocab_targets_only`) against direct
computations, segment sums under every option, and the fused TV term against autograd's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from peagle_core.model import loss as loss_module
from peagle_core.model.loss import fused_kl_loss, reference_kl_loss
from peagle_core.model.objective import Objective, Teacher, distillation_loss, loss_positions, sample_rows
from peagle_core.model.partition import partitioned_backward
from tests.core.model.test_model import VOCAB, H, packed_batch, tiny_model

OBJECTIVES = {
    "equal": Objective("equal"),
    "count": Objective("count"),
    "list": Objective((4.0, 2.0, 1.0, 1.0)),
    "tv": Objective("count", tv_weight=0.7),
    "in_vocab": Objective("equal", in_vocab_targets_only=True),
    "all": Objective((1.0, 0.0, 3.0, 1.0), tv_weight=0.3, in_vocab_targets_only=True),
}


def _teacher_with_full_head(model, seed: int = 3) -> Teacher:
    g = torch.Generator().manual_seed(seed)
    norm = torch.nn.RMSNorm(H, eps=1e-6)
    full = torch.randn(VOCAB, H, generator=g)
    # Make roughly half the positions' greedy token fall outside the draft vocabulary.
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[model.verifier_ids()] = False
    full[outside] *= 1.6
    return Teacher.from_verifier(norm, full, model.verifier_ids(), keep_full_lm_head=True)


def _direct_loss(model, teacher: Teacher, batch, rows, objective: Objective) -> torch.Tensor:
    """The batch's loss written out: every row's KL (+ TV) from materialised distributions, its depth's
    weight by the objective's rule, the rows filtered by hand."""
    anchor, depth = rows
    target = anchor + depth
    t = batch.input_ids.shape[1]
    mask = loss_positions(batch).bool()
    normed = teacher(batch.verifier_last_hidden_states[0])
    if objective.in_vocab_targets_only:
        greedy = (normed @ teacher.full_lm_head.T).argmax(-1)
        mask &= torch.isin(greedy, model.verifier_ids())
    keep = (target < t) & mask[target.clamp_max(t - 1)]
    hidden = model(
        batch.hidden_states[0],
        batch.input_ids[0],
        batch.position_ids[0],
        batch.document_ids[0],
        anchor,
        depth,
    )[keep]
    logp = F.log_softmax(normed[target[keep]] @ teacher.lm_head.T, -1)
    logq = F.log_softmax(hidden @ model.lm_head.weight.T, -1)
    row = (logp.exp() * (logp - logq)).sum(-1) + objective.tv_weight * 0.5 * (
        logq.exp() - logp.exp()
    ).abs().sum(-1)
    d = depth[keep]
    depths = range(model.config.num_depths)
    means = {k: row[d == k].mean() for k in depths if (d == k).any()}
    if objective.depth_weights == "count":
        return row.mean()
    if objective.depth_weights == "equal":
        return sum(means.values()) / len(means)
    w = {k: objective.depth_weights[k] for k in means}
    return sum(w[k] * means[k] for k in means) / sum(w.values())


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_loss_options_equal_a_direct_computation(name: str) -> None:
    objective = OBJECTIVES[name]
    model, _ = tiny_model(seed=1)
    teacher = _teacher_with_full_head(model)
    batch = packed_batch(seed=2, lengths=(31, 26, 12))
    rows = sample_rows(model.config, batch, torch.Generator().manual_seed(5))
    got = distillation_loss(model, teacher, batch, rows, objective=objective)
    want = _direct_loss(model, teacher, batch, rows, objective)
    torch.testing.assert_close(got.loss, want, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(got.loss, list(model.parameters()), allow_unused=True)
    grads_want = torch.autograd.grad(want, list(model.parameters()), allow_unused=True)
    for a, b in zip(grads, grads_want, strict=True):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_depth_weightings_differ_where_depths_have_different_counts() -> None:
    # The options must change the loss, or the tests above could pass on one rule applied everywhere.
    model, _ = tiny_model(seed=1)
    teacher = _teacher_with_full_head(model)
    batch = packed_batch(seed=2, lengths=(31, 26, 12))
    rows = sample_rows(model.config, batch, torch.Generator().manual_seed(5))
    losses = {
        n: float(distillation_loss(model, teacher, batch, rows, objective=o).loss.detach())
        for n, o in OBJECTIVES.items()
    }
    assert len({round(v, 6) for v in losses.values()}) == len(losses)


def test_in_vocab_targets_only_drops_rows_and_counts() -> None:
    model, _ = tiny_model(seed=1)
    teacher = _teacher_with_full_head(model)
    batch = packed_batch(seed=2, lengths=(31, 26, 12))
    rows = sample_rows(model.config, batch, torch.Generator().manual_seed(5))
    every = distillation_loss(model, teacher, batch, rows).metrics
    kept = distillation_loss(model, teacher, batch, rows, objective=OBJECTIVES["in_vocab"]).metrics
    assert 0 < int(kept["positions_0"]) < int(every["positions_0"])


def test_a_teacher_without_the_full_head_refuses_in_vocab_filtering() -> None:
    model, teacher = tiny_model(seed=1)
    batch = packed_batch(seed=2)
    rows = sample_rows(model.config, batch, torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="keep_full_lm_head"):
        distillation_loss(model, teacher, batch, rows, objective=OBJECTIVES["in_vocab"])


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_segments_sum_to_the_whole_under_every_option(name: str) -> None:
    model, _ = tiny_model(seed=4)
    teacher = _teacher_with_full_head(model)
    batch = packed_batch(seed=6, lengths=(40, 25, 31))

    def grads(segments: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        g = torch.Generator().manual_seed(7)
        metrics = partitioned_backward(
            model, teacher, batch, segments, generator=g, objective=OBJECTIVES[name]
        )
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, metrics

    whole, m_whole = grads(1)
    split, m_split = grads(3)
    torch.testing.assert_close(m_split["loss"], m_whole["loss"], rtol=1e-5, atol=1e-6)
    for n, g in whole.items():
        torch.testing.assert_close(split[n], g, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_fused_tv_term_equals_reference_forward_and_gradients(compiled: bool, monkeypatch) -> None:
    monkeypatch.setenv("PEAGLE_COMPILE", "1" if compiled else "0")
    monkeypatch.setattr(loss_module, "_CHUNK_LOGIT_BYTES", 4 * 500 * 64)  # several chunks per call
    g = torch.Generator().manual_seed(0)
    h = torch.randn(200, 16, generator=g).requires_grad_()
    w = (0.4 * torch.randn(500, 16, generator=g)).requires_grad_()
    th, tw = torch.randn(60, 16, generator=g), 0.4 * torch.randn(500, 16, generator=g)
    target, row_w = torch.randint(0, 60, (200,), generator=g), torch.rand(200, generator=g)
    got = fused_kl_loss(h, w, th, tw, target, row_w, tv_weight=1.5)
    want = reference_kl_loss(h, w, th, tw, target, row_w, tv_weight=1.5)
    assert (
        float((want - reference_kl_loss(h, w, th, tw, target, row_w)).detach()) > 0.1
    )  # the TV term is there
    torch.testing.assert_close(got.loss, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad(got.loss, (h, w)), torch.autograd.grad(want, (h, w)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
