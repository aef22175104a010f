"""The KV-cached, batched evaluator (peagle_core.evaluation.speculate) against the full-recompute reference and plain
greedy decoding on the toy verifier, token for token and step for step.

Why exact equality holds: both evaluators run the verifier in fp32, and a cached or left-padded pass
computes the same logits as a full pass up to rounding (`test_cached_pass_matches_full_pass` bounds the
difference at 1e-4). An argmax can only flip where the top two logits are closer than that; the toy's
smallest top-1/top-2 gap along these outputs is checked to be far larger (`MIN_GAP`), so every greedy
choice, draft comparison and acceptance count is the same. A verifier with near-ties (bf16, or a larger
model on long outputs) would need a tolerance: compare tokens only up to the first position whose gap is
below the drift.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peagle_core.evaluation.acceptance import (
    evaluate,
    greedy_decode,
    held_out_prompts,
    speculative_decode,
)
from peagle_core.evaluation.speculate import speculative_decode_batch

K = 4  # the trained drafter's depths: every K from 1 to 4 is evaluated
MIN_GAP = 1e-3  # ten times the drift bound of test_cached_pass_matches_full_pass


@pytest.fixture(scope="module")
def drafter(tmp_path_factory, toy_verifier_dir: Path, toy_dataset_path: Path):
    """A briefly trained drafter: it gets drafts accepted (AL about 1.3 on these prompts), so acceptance
    counts differ between rows and steps and the cache is cropped and masked per row."""
    from peagle_core.pipeline.stages import run_pipeline
    from peagle_core.spec import parse_spec

    spec = parse_spec(
        {
            "verifier": {"name_or_path": str(toy_verifier_dir)},
            "dataset": {"path": str(toy_dataset_path), "seq_len": 128, "val_fraction": 0.1},
            "hidden_states": {"mode": "online"},
            "model": {"num_layers": 1, "num_depths": K, "draft_vocab_size": 256},
            "training": {"total_seq_len": 256, "lr": 3e-3, "warmup_ratio": 0.1, "seed": 3, "epochs": 4},
            "evaluation": {"prompts": 0},
            "export": {"vllm_check": False},
        }
    )
    result = run_pipeline(spec, tmp_path_factory.mktemp("speculate_job"), resume=False)
    assert result.status == "completed"
    return result.model.eval()


@pytest.fixture(scope="module")
def prompts(prepared_dataset: Path) -> list[torch.Tensor]:
    """Held-out prompts of different lengths, plus a 3-token one (much more left padding in its batch)."""
    from peagle_core.data import PreparedDataset

    found = held_out_prompts(PreparedDataset.open(prepared_dataset), range(60), limit=6)
    return [*found, found[0][:3]]


@pytest.fixture(scope="module")
def greedy(toy_verifier, prompts) -> list[list[int]]:
    """Plain greedy outputs (40 tokens at most), and a check that no greedy choice is a near-tie."""
    eos = toy_verifier.tokenizer.eos_token_id
    outputs = [greedy_decode(toy_verifier, p, 40, eos) for p in prompts]
    for p, out in zip(prompts, outputs, strict=True):
        logits, _ = toy_verifier.logits(torch.cat([p, torch.tensor(out)])[None])
        top2 = logits[0, len(p) - 1 :].topk(2, dim=-1).values
        assert float((top2[:, 0] - top2[:, 1]).min()) > MIN_GAP
    return outputs


def test_cached_pass_matches_full_pass(toy_verifier, prompts) -> None:
    """Left-padded prefill plus a cached extension gives a full pass's logits and aux states (to 1e-4)."""
    from transformers import DynamicCache

    a, b = prompts[0], prompts[-1]
    extra = torch.tensor([[5, 6, 7], [8, 9, 10]])
    width = max(len(a), len(b))
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for row, p in enumerate((a, b)):
        ids[row, width - len(p) :], mask[row, width - len(p) :] = p, 1
    cache = DynamicCache()
    toy_verifier.extend(ids, mask, (mask.cumsum(-1) - 1).clamp_min(0), cache)
    lengths = torch.tensor([len(a), len(b)])
    pos = lengths[:, None] + torch.arange(3)
    logits, aux = toy_verifier.extend(
        extra, torch.cat([mask, torch.ones(2, 3, dtype=torch.long)], 1), pos, cache
    )
    for row, p in enumerate((a, b)):
        full_logits, full_aux = toy_verifier.logits(torch.cat([p, extra[row]])[None])
        torch.testing.assert_close(logits[row], full_logits[0, -3:], rtol=0, atol=1e-4)
        torch.testing.assert_close(aux[row], full_aux[0, -3:], rtol=0, atol=1e-4)


@pytest.mark.parametrize("k", range(1, K + 1))
def test_cached_evaluator_equals_reference_and_greedy(toy_verifier, drafter, prompts, greedy, k: int) -> None:
    eos = toy_verifier.tokenizer.eos_token_id
    for max_new in (40, 7):
        reference = evaluate(drafter, toy_verifier, prompts, k, max_new, eos, reference=True)
        cached = evaluate(
            drafter, toy_verifier, prompts, k, max_new, eos, batch_size=3
        )  # 3 batches, last of 1
        assert reference.tokens == [g[:max_new] for g in greedy]
        assert cached.tokens == reference.tokens
        assert cached.to_dict() == reference.to_dict()  # AL, per-position rates, verifier passes
    # the cases the equality covers: EOS before the limit, the limit before EOS, accepted drafts
    assert any(out[-1] == eos and len(out) < 40 for out in greedy)
    assert any(len(out) > 7 for out in greedy)
    assert reference.acceptance_length > 1.0


def test_drafter_cache_changes_nothing(toy_verifier, drafter, prompts) -> None:
    """The drafter's depth-0 K/V cache and its full recomputation decide the same steps."""
    eos = toy_verifier.tokenizer.eos_token_id
    args = (drafter, toy_verifier, prompts, K, 40, eos)
    assert speculative_decode_batch(*args, drafter_cache=True) == speculative_decode_batch(
        *args, drafter_cache=False
    )


class Oracle(torch.nn.Module):
    """A drafter that knows the greedy outputs and spoils one draft at a position that varies by prompt and
    step, so every acceptance count 0..K occurs and rows of one batch accept different amounts."""

    def __init__(self, prompts: list[torch.Tensor], greedy: list[list[int]], vocab: int):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # evaluate() reads the drafter's device and dtype
        self.sequences = [p[1:].tolist() + g for p, g in zip(prompts, greedy, strict=True)]
        self.prompt_lengths = [len(p) for p in prompts]
        self.vocab = vocab

    def draft(self, hidden_states, input_ids, attention_mask=None, k=None):
        rows = []
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        for ids, real in zip(input_ids, attention_mask.bool(), strict=True):
            ids = ids[real].tolist()  # the aligned ids: prompt[1:] + generated
            i = next(i for i, s in enumerate(self.sequences) if s[: len(ids)] == ids)
            done = len(ids) + 1 - self.prompt_lengths[i]
            ahead = self.sequences[i][len(ids) : len(ids) + k]
            ahead += [0] * (k - len(ahead))
            wrong = (3 * done + 5 * i) % (k + 2)  # k or k+1: nothing spoilt
            if wrong < k:
                ahead[wrong] = (ahead[wrong] + 1) % self.vocab
            rows.append(ahead)
        return torch.tensor(rows)


def test_varied_acceptance_decides_the_same_steps(toy_verifier, prompts, greedy) -> None:
    eos = toy_verifier.tokenizer.eos_token_id
    oracle = Oracle(prompts, greedy, toy_verifier.vocab_size)
    k = 3
    batched = speculative_decode_batch(oracle, toy_verifier, prompts, k, 40, eos, drafter_cache=False)
    one_by_one = [speculative_decode(oracle, toy_verifier, p, k, 40, eos) for p in prompts]
    assert batched == one_by_one
    assert [tokens for tokens, _ in batched] == greedy
    assert {a for _, accepted in batched for a in accepted} == set(range(k + 1))


def test_no_speculative_step_when_the_first_token_ends_it(toy_verifier, drafter, prompts) -> None:
    eos = toy_verifier.tokenizer.eos_token_id
    result = evaluate(drafter, toy_verifier, prompts, 2, 1, eos)
    assert result.tokens == evaluate(drafter, toy_verifier, prompts, 2, 1, eos, reference=True).tokens
    assert result.verifier_passes == 0 and result.acceptance_length == 0.0
    with pytest.raises(ValueError, match="k must be"):
        evaluate(drafter, toy_verifier, prompts, 0, 4, eos)
