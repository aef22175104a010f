"""The P-EAGLE drafter and its objective: checkpoint names, gradient flow, overfitting, draft/forward consistency."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from peagle_core.model.config import PEagleConfig
from peagle_core.model.drafter import PEagleDraftModel
from peagle_core.model.loss import fused_kl_loss, reference_kl_loss
from peagle_core.model.objective import LossOutput, Teacher, distillation_loss, sample_rows

H, VOCAB, DRAFT_VOCAB = 32, 97, 40


def tiny_model(
    seed: int = 0, num_layers: int = 2, num_depths: int = 4, **overrides
) -> tuple[PEagleDraftModel, Teacher]:
    """A small drafter with a random draft vocabulary, and the teacher of a random verifier head."""
    torch.manual_seed(seed)
    settings = {
        "hidden_size": H,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 64,
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
        "num_layers": num_layers,
        "num_depths": num_depths,
        "aux_layer_ids": [2, 4, 5],
        "mask_token_id": VOCAB - 1,
    }
    config = PEagleConfig(**{**settings, **overrides})
    model = PEagleDraftModel(config)
    targets = torch.randperm(VOCAB - 1)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[targets] = True
    norm = LlamaRMSNorm(H, eps=1e-6)
    torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    model.set_vocab_map(t2d, targets - torch.arange(DRAFT_VOCAB))
    return model, Teacher.from_verifier(norm, torch.randn(VOCAB, H), model.verifier_ids())


def packed_batch(seed: int = 0, lengths: tuple[int, ...] = (23, 17), pad: int = 5) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((pad,), -1)])
    t = docs.numel()
    positions = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(pad, dtype=torch.long)])
    loss_mask = (torch.rand(t, generator=g) < 0.8).long() * (docs >= 0)
    return SimpleNamespace(
        hidden_states=torch.randn(1, t, 3 * H, generator=g),
        input_ids=torch.randint(0, VOCAB - 1, (1, t), generator=g),
        verifier_last_hidden_states=torch.randn(1, t, H, generator=g),
        loss_mask=loss_mask[None],
        document_ids=docs[None],
        position_ids=positions[None],
    )


def run(model: PEagleDraftModel, teacher: Teacher, batch: SimpleNamespace, generator=None) -> LossOutput:
    return distillation_loss(model, teacher, batch, sample_rows(model.config, batch, generator))


def test_state_dict_is_the_checkpoint_contract() -> None:
    model, _ = tiny_model(num_layers=3)
    names = set(model.state_dict())
    expected = {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "embed_tokens.weight",
        "mask_hidden",
        "d2t",
        "t2d",
    }
    expected.add("layers.0.hidden_norm.weight")
    for i in range(3):
        for proj in ("q", "k", "v", "o"):
            expected.add(f"layers.{i}.self_attn.{proj}_proj.weight")
        for proj in ("gate", "up", "down"):
            expected.add(f"layers.{i}.mlp.{proj}_proj.weight")
        expected |= {f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight"}
    assert names == expected
    state = model.state_dict()
    assert state["mask_hidden"].shape == (1, 1, 3 * H)
    assert state["layers.0.self_attn.q_proj.weight"].shape == (32, 2 * H)
    assert state["layers.1.self_attn.k_proj.weight"].shape == (16, H)
    assert state["lm_head.weight"].shape == (DRAFT_VOCAB, H)
    assert state["embed_tokens.weight"].shape == (VOCAB, H)
    assert state["d2t"].dtype == torch.long and state["t2d"].dtype == torch.bool


def test_gradient_reaches_every_parameter() -> None:
    model, teacher = tiny_model()
    out = run(model, teacher, packed_batch(), generator=torch.Generator().manual_seed(0))
    assert int(out.metrics["positions_3"]) > 0
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and bool(p.grad.abs().sum() > 0), name
    assert bool(model.embed_tokens.weight.grad[VOCAB - 1].abs().sum() > 0), (
        "the mask token's embedding learns"
    )


def test_fused_loss_matches_reference() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(30, H, requires_grad=True)
    weight = torch.randn(DRAFT_VOCAB, H, requires_grad=True)
    teacher, teacher_w = torch.randn(12, H), torch.randn(DRAFT_VOCAB, H)
    target, row_w = torch.randint(0, 12, (30,)), torch.rand(30)
    fused = fused_kl_loss(hidden, weight, teacher, teacher_w, target, row_w).loss
    ref = reference_kl_loss(hidden, weight, teacher, teacher_w, target, row_w)
    g_fused = torch.autograd.grad(fused * 2, (hidden, weight))
    g_ref = torch.autograd.grad(ref * 2, (hidden, weight))
    torch.testing.assert_close(fused, ref)
    for a, b in zip(g_fused, g_ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm_before_residual", [True, False])
def test_tiny_model_overfits_one_batch(norm_before_residual: bool) -> None:
    model, teacher = tiny_model(norm_before_residual=norm_before_residual)
    batch = packed_batch(lengths=(30,), pad=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for step in range(150):
        out = run(model, teacher, batch, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(float(out.loss.detach()))
    assert losses[-1] <= 0.1 * losses[0], (losses[0], losses[-1])
    assert float(out.metrics["acc_0"]) > 0.9


def test_draft_matches_training_forward() -> None:
    model, _ = tiny_model(seed=1)
    model.eval()
    batch = packed_batch(seed=1, lengths=(26,), pad=0)
    t, k = batch.input_ids.shape[1], 4
    last = t - 1
    cod = (
        torch.cat([torch.arange(t), torch.full((k - 1,), last)]),
        torch.cat([torch.zeros(t, dtype=torch.long), torch.arange(1, k)]),
    )
    with torch.no_grad():
        hidden = model(
            batch.hidden_states[0], batch.input_ids[0], batch.position_ids[0], batch.document_ids[0], *cod
        )
        logits = model.lm_head(hidden)
    chain_rows = torch.cat([torch.tensor([last]), torch.arange(t, t + k - 1)])
    expected = logits[chain_rows].argmax(-1)
    expected = expected + model.d2t[expected]

    drafted = model.draft(batch.hidden_states, batch.input_ids, k=k)
    assert drafted.shape == (1, k)
    assert drafted[0].tolist() == expected.tolist()
    assert bool(model.t2d[drafted[0]].all()), "drafts are in the verifier vocabulary"

    # Batched with left padding, every row drafts what it drafts alone.
    short = 19
    hidden = torch.zeros(2, t, 3 * H)
    ids = torch.zeros(2, t, dtype=torch.long)
    hidden[0], ids[0] = batch.hidden_states[0], batch.input_ids[0]
    hidden[1, t - short :], ids[1, t - short :] = batch.hidden_states[0, :short], batch.input_ids[0, :short]
    attn = torch.ones(2, t, dtype=torch.long)
    attn[1, : t - short] = 0
    both = model.draft(hidden, ids, attention_mask=attn, k=k)
    alone = model.draft(batch.hidden_states[:, :short], batch.input_ids[:, :short], k=k)
    assert both[0].tolist() == drafted[0].tolist()
    assert both[1].tolist() == alone[0].tolist()


@pytest.mark.parametrize(
    "overrides", [{}, {"layer_type": "qwen3"}, {"norm_before_residual": True}], ids=["llama", "qwen3", "nbr"]
)
def test_draft_step_matches_full_draft(overrides: dict) -> None:
    """Drafting from the depth-0 K/V cache (peagle_core.evaluation.draft_cache) proposes what `draft` proposes over the
    whole sequence, step after step, for a batch whose rows grow by different amounts (1..k+1 rows)."""
    from peagle_core.evaluation.draft_cache import DraftCache, draft_step

    model, _ = tiny_model(seed=2, num_layers=2, **overrides)
    model.eval()
    # At the default init (std 0.02) attention barely moves the drafts, which then ignore the context and
    # could not reveal a wrong cache, mask or position; at 0.25 perturbing earlier rows changes them.
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.25)
    k = 4
    g = torch.Generator().manual_seed(2)
    lengths = [11, 4, 7]  # aligned rows each sequence starts with
    total = max(lengths) + 6 * (k + 1)
    hidden = torch.randn(len(lengths), total, 3 * H, generator=g)
    ids = torch.randint(0, VOCAB - 1, (len(lengths), total), generator=g)
    cache = DraftCache(len(model.layers), len(lengths), torch.device("cpu"))
    done = [0] * len(lengths)
    grow = lengths
    for step in range(6):
        width = max(grow)
        h_new = torch.zeros(len(lengths), width, 3 * H)
        i_new = torch.zeros(len(lengths), width, dtype=torch.long)
        real = torch.zeros(len(lengths), width, dtype=torch.bool)
        for b, n in enumerate(grow):
            h_new[b, width - n :], i_new[b, width - n :] = (
                hidden[b, done[b] : done[b] + n],
                ids[b, done[b] : done[b] + n],
            )
            real[b, width - n :] = True
            done[b] += n
        stepped = draft_step(model, cache, h_new, i_new, real, k)
        for b in range(len(lengths)):
            full = model.draft(hidden[b : b + 1, : done[b]], ids[b : b + 1, : done[b]], k=k)
            assert stepped[b].tolist() == full[0].tolist(), (step, b)
        grow = torch.randint(1, k + 2, (len(lengths),), generator=g).tolist()
    # finished sequences leave the batch; the others keep drafting from their own rows
    cache.select(torch.tensor([2, 0]))
    h_new, i_new = hidden[[2, 0], done[2] : done[2] + 1], ids[[2, 0], done[2] : done[2] + 1]
    h_new[1], i_new[1] = hidden[0, done[0]], ids[0, done[0]]
    stepped = draft_step(model, cache, h_new, i_new, torch.ones(2, 1, dtype=torch.bool), k)
    for row, b in enumerate((2, 0)):
        full = model.draft(hidden[b : b + 1, : done[b] + 1], ids[b : b + 1, : done[b] + 1], k=k)
        assert stepped[row].tolist() == full[0].tolist()
