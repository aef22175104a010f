"""EAGLE-3's training-time test against a slow reference that loops over steps, rows and keys, forward and
gradients; its rows; and greedy drafting equal to step-by-step decoding."""

from __future__ import annotations

import math

import pytest
import torch

from peagle_core.model.drafter import PEagleDraftModel
from peagle_core.model.eagle3 import ttt_rows, unrolled_forward
from peagle_core.model.loss import reference_kl_loss
from peagle_core.model.objective import Teacher, distillation_loss, sample_rows
from tests.core.model.test_model import packed_batch, tiny_model

STEPS = 3


class _LoopAttention:
    """Attention by hand, one query row and one head at a time, over the keys the TTT rule lets it see:
    step-0 rows of its document up to its anchor, and its own chain's rows at steps 1..s."""

    def __init__(self, store: dict, rows: list[tuple[int, int]], docs: list[int]):
        self.store, self.rows, self.docs = store, rows, docs

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        for i, row in enumerate(self.rows):
            self.store[row] = (k[i], v[i])
        heads, head_dim = q.shape[1], q.shape[2]
        group = heads // k.shape[1]
        out = []
        for i, (a, s) in enumerate(self.rows):
            doc = self.docs[a]
            if doc < 0:  # padding sees nothing
                out.append(torch.zeros_like(q[i]))
                continue
            seen = [(b, 0) for b in range(a + 1) if self.docs[b] == doc] + [(a, t) for t in range(1, s + 1)]
            per_head = []
            for h in range(heads):
                keys = torch.stack([self.store[r][0][h // group] for r in seen])
                values = torch.stack([self.store[r][1][h // group] for r in seen])
                weights = torch.softmax(keys @ q[i, h] / math.sqrt(head_dim), dim=0)
                per_head.append(weights @ values)
            out.append(torch.stack(per_head))
        return torch.stack(out)


def reference_ttt(model: PEagleDraftModel, teacher: Teacher, batch) -> tuple[torch.Tensor, dict]:
    """The TTT loss the obvious way: step by step, each row's inputs picked by hand (step 0: fc of the
    verifier's aux state and the real token; step s: the row's own pre-norm output at step s-1 and the
    token s places on), attention looped per row and head, KL per row averaged over the loss rows."""
    ids, docs = batch.input_ids[0].tolist(), batch.document_ids[0].tolist()
    pos, loss_mask = batch.position_ids[0].tolist(), batch.loss_mask[0].tolist()
    n = len(ids)
    teacher_rows = teacher(batch.verifier_last_hidden_states[0])
    stores = [{} for _ in model.layers]
    prenorm: dict[int, torch.Tensor] = {}
    normed: dict[tuple[int, int], torch.Tensor] = {}
    for s in range(STEPS):
        anchors = [a for a in range(n) if s == 0 or (a + s < n and docs[a] >= 0 and docs[a + s] == docs[a])]
        rows = [(a, s) for a in anchors]
        if s == 0:
            hidden = torch.stack([model.fc(batch.hidden_states[0, a]) for a in anchors])
        else:
            hidden = torch.stack([prenorm[a] for a in anchors])
        embeds = model.embed_tokens(torch.tensor([ids[min(a + s, n - 1)] for a in anchors]))
        cos, sin = model.rotary_emb(hidden, torch.tensor([[pos[a] + s for a in anchors]]))
        cos, sin = cos[0], sin[0]
        h, res = model.layers[0](
            hidden, None, cos, sin, _LoopAttention(stores[0], rows, docs), "dense", embeds=embeds
        )
        for layer, store in zip(model.layers[1:], stores[1:], strict=True):
            h, res = layer(h, res, cos, sin, _LoopAttention(store, rows, docs), "dense")
        out = h + res
        for i, a in enumerate(anchors):
            prenorm[a] = out[i]
            normed[(a, s)] = model.norm(out[i])
    loss_rows = [(a, s) for (a, s) in normed if a + s < n and loss_mask[a + s] == 1]
    losses = [
        reference_kl_loss(
            normed[r][None], model.lm_head.weight, teacher_rows, teacher.lm_head,
            torch.tensor([r[0] + r[1]]), torch.ones(1),
        )
        for r in loss_rows
    ]  # fmt: skip
    return torch.stack(losses).mean(), normed


def eagle3_model(**overrides):
    return tiny_model(method="eagle3", num_depths=STEPS, **overrides)


@pytest.mark.parametrize("backend", ["dense", "chunked", "fused"])
def test_ttt_loss_and_gradients_equal_the_slow_reference(backend: str) -> None:
    model, teacher = eagle3_model()
    model.attention_backend = backend
    batch = packed_batch(seed=3, lengths=(13, 9), pad=3)
    rows = sample_rows(model.config, batch)
    out = distillation_loss(model, teacher, batch, rows)
    out.loss.backward()
    fast = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    ref, normed = reference_ttt(model, teacher, batch)
    ref.backward()
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-6)
    assert set(fast) == {name for name, p in model.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        torch.testing.assert_close(fast[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    # Each step trained something and the steps differ (the feed is not the step-0 input again).
    assert all(out.metrics[f"positions_{s}"] > 0 for s in range(STEPS))
    hidden = model(
        batch.hidden_states[0], batch.input_ids[0], batch.position_ids[0], batch.document_ids[0], *rows
    )
    anchors, steps = rows
    for i in range(0, anchors.numel(), 5):
        torch.testing.assert_close(hidden[i], normed[(int(anchors[i]), int(steps[i]))], rtol=1e-5, atol=1e-5)


def test_ttt_rows_keep_every_in_document_chain_to_ttt_steps() -> None:
    docs = torch.tensor([0, 0, 0, 0, 1, 1, 1, -1])
    anchors, steps = ttt_rows(8, docs, 3)
    got = {(int(a), int(s)) for a, s in zip(anchors, steps, strict=True)}
    assert {a for a, s in got if s == 0} == set(range(8))
    assert {a for a, s in got if s == 1} == {0, 1, 2, 4, 5}
    assert {a for a, s in got if s == 2} == {0, 1, 4}
    assert torch.equal(steps, steps.sort().values)
    # model.ttt_steps, not num_depths, sets how far the training rows unroll.
    model, _ = eagle3_model(ttt_steps=2)
    batch = packed_batch(seed=1)
    assert int(sample_rows(model.config, batch)[1].max()) == 1


def test_greedy_drafting_equals_one_token_at_a_time() -> None:
    model, _ = eagle3_model()
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 7, 3 * 32, generator=g)
    ids = torch.randint(0, 90, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    drafts = model.draft(hidden, ids, mask, k=3)
    # By hand, one sequence and one draft at a time: the teacher-forced forward over the real tokens
    # followed by the drafts so far; its last row (the last anchor at the newest step) gives the next draft.
    for b in range(2):
        real = mask[b].bool()
        n = int(real.sum())
        got: list[int] = []
        for step in range(3):
            seq_ids = torch.cat([ids[b][real], torch.tensor(got, dtype=torch.long)])
            anchors = torch.cat([torch.arange(n), torch.full((step,), n - 1)])
            depth = torch.cat([torch.zeros(n, dtype=torch.long), torch.arange(1, step + 1)])
            out = unrolled_forward(
                model, hidden[b][real], seq_ids, torch.arange(n + step), torch.zeros(n + step, dtype=torch.long),
                anchors, depth,
            )  # fmt: skip
            got.append(int(model.verifier_ids()[model.lm_head(out[-1]).argmax()]))
        assert drafts[b].tolist() == got


def test_eagle3_drafter_has_no_mask_hidden_and_peagle_keeps_it() -> None:
    model, _ = eagle3_model()
    assert "mask_hidden" not in model.state_dict()
    assert "mask_hidden" in tiny_model()[0].state_dict()
    # Every EAGLE-3 parameter gets a gradient (DDP needs no unused-parameter search).
    _, teacher = eagle3_model()
    batch = packed_batch()
    distillation_loss(model, teacher, batch, sample_rows(model.config, batch)).loss.backward()
    assert all(p.grad is not None for p in model.parameters())
