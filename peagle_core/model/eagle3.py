"""EAGLE-3's forward: the drafter unrolled over steps on its own outputs (training-time test, TTT).

Row (anchor a, step s) predicts aligned target a + s, as P-EAGLE's (a, depth s) does. Step 0 reads
fc(the verifier's aux hidden state) and the real token; step s reads the pre-norm output of (a, s-1) and
the token at a + s (the ground truth shifted, as speculators' trainer feeds it) or, when drafting, the
drafter's own greedy token. Row (a, s) attends the step-0 rows of its document up to a and its own chain
(a, 1..s): P-EAGLE's visibility rule (peagle_core.model.attention), so its kernels serve both methods.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from peagle_core.model.attention import AttentionLayout, Backend, parallel_group_attention

Feed = Literal["teacher", "greedy"]  # what step s >= 1 reads as its token


def ttt_rows(seq_len: int, document_ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchor_pos, step) of every row TTT trains on one packed sequence: every position at step 0, and at
    step s every anchor whose target a + s lies in its own document (a chain past the document's end
    predicts nothing). Grouped by step, anchors ascending, on the ids' device."""
    docs = document_ids.reshape(-1)
    device = docs.device
    anchors = [torch.arange(seq_len, device=device)]
    for s in range(1, steps):
        a = torch.arange(max(seq_len - s, 0), device=device)
        keep = (docs[a] == docs[a + s]) & (docs[a] >= 0)
        if not bool(keep.any()):
            break
        anchors.append(a[keep])
    depth = torch.cat([torch.full_like(a, s) for s, a in enumerate(anchors)])
    return torch.cat(anchors), depth


class _StepAttention:
    """One layer's attention at step s: the step's queries over the keys of steps 0..s.

    Earlier steps' q, k, v are kept (with their graph), and the attention runs over every row so far
    under the layout of steps 0..s; only the step's own outputs are returned. The earlier rows' outputs
    are recomputed and dropped: attention costs 1 + 2 + ... + S row-passes, but the kernels stay the
    shared ones (fused on CPU, FlexAttention on CUDA) instead of a second implementation.
    """

    def __init__(self, cache: list[list[torch.Tensor]], layout: AttentionLayout, backend: Backend):
        self.cache, self.layout, self.backend = cache, layout, backend

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        for store, t in zip(self.cache, (q, k, v), strict=True):
            store.append(t)
        qs, ks, vs = (torch.cat(store) if len(store) > 1 else store[0] for store in self.cache)
        out = parallel_group_attention(qs, ks, vs, self.layout, self.backend)
        return out[-q.shape[0] :]


def _step_slices(depth: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each step's rows; steps must be 0, 1, ... in order, each present."""
    counts = torch.bincount(depth).tolist()
    if not counts or 0 in counts or bool((torch.diff(depth) < 0).any()):
        raise ValueError("TTT rows must be grouped by step 0, 1, ..., with every step present")
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c
    return bounds


def unrolled_forward(
    model: nn.Module,
    hidden_states: torch.Tensor,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    document_ids: torch.Tensor,
    anchor_pos: torch.Tensor,
    depth: torch.Tensor,
    feed: Feed = "teacher",
) -> torch.Tensor:
    """Final-normed hidden states [N, H] of rows (anchor_pos, depth = step) of one flat sequence.

    `model` is the drafter (`PEagleDraftModel` with method eagle3: its fc, embeddings, layers, norm and,
    for `feed="greedy"`, lm_head and vocabulary map). Inputs as `PEagleDraftModel.forward`; the anchors of
    step s must be among those of step s-1. `feed="teacher"` gives step s the token input_ids[a + s]
    (training); `"greedy"` the argmax of step s-1's draft (drafting, as vLLM does).
    """
    m: Any = model
    bounds = _step_slices(depth)
    backend = m.attention_backend
    caches: list[list[list[torch.Tensor]]] = [[[], [], []] for _ in m.layers]
    seq_len = input_ids.shape[0]

    outs: list[torch.Tensor] = []
    prev_anchor = prev_prenorm = prev_normed = None
    for s, (r0, r1) in enumerate(bounds):
        anchors = anchor_pos[r0:r1]
        if s == 0:
            hidden = m.fc(hidden_states[anchors])
            tokens = input_ids[anchors]
        else:
            # each anchor's row at the previous step (anchors ascend within a step)
            where = torch.searchsorted(prev_anchor, anchors)
            if bool((where >= prev_anchor.numel()).any()) or not torch.equal(prev_anchor[where], anchors):
                raise ValueError(f"step {s} has anchors without a row at step {s - 1}")
            hidden = prev_prenorm[where]
            if feed == "teacher":
                tokens = input_ids[(anchors + s).clamp_max(seq_len - 1)]
            else:
                tokens = m.verifier_ids()[m.lm_head(prev_normed[where]).argmax(-1)]
        positions = position_ids[anchors] + s
        cos, sin = m.rotary_emb(hidden, positions[None])
        cos, sin = cos[0], sin[0]
        # The rows of steps 0..s under the visibility rule, shared by every layer of this step.
        layout = AttentionLayout.build(
            anchor_pos[:r1], depth[:r1], document_ids, m.config.num_attention_heads
        )
        h, residual = m.layers[0](
            hidden, None, cos, sin, _StepAttention(caches[0], layout, backend), backend,
            embeds=m.embed_tokens(tokens),
        )  # fmt: skip
        for layer, cache in zip(m.layers[1:], caches[1:], strict=True):
            h, residual = layer(h, residual, cos, sin, _StepAttention(cache, layout, backend), backend)
        prenorm = h + residual
        normed = m.norm(prenorm)
        outs.append(normed)
        prev_anchor, prev_prenorm, prev_normed = anchors, prenorm, normed
    return torch.cat(outs)
