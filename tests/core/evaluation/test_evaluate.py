"""Acceptance-length evaluation: speculative decoding must reproduce the verifier's greedy output exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peagle_core.evaluation.acceptance import (
    evaluate,
    greedy_decode,
    held_out_prompts,
    prompt_of,
    speculative_decode,
)


@pytest.fixture(scope="module")
def drafter_and_prompts(toy_verifier, prepared_dataset: Path):
    from peagle_core.data import PreparedDataset
    from peagle_core.model.config import PEagleConfig
    from peagle_core.model.drafter import PEagleDraftModel

    ds = PreparedDataset.open(prepared_dataset)
    torch.manual_seed(0)
    config = PEagleConfig.from_verifier(
        toy_verifier.config,
        num_layers=1,
        num_depths=4,
        draft_vocab_size=int(ds.d2t.numel()),
        mask_token_id=ds.mask_token_id,
        aux_layer_ids=list(toy_verifier.layer_ids),
    )
    model = PEagleDraftModel(config)
    model.init_embeddings(toy_verifier.embed_weight.detach().float())
    model.set_vocab_map(ds.t2d, ds.d2t)
    prompts = held_out_prompts(ds, range(len(ds)), limit=3)
    return model.eval(), prompts


def test_prompt_is_the_part_before_the_first_assistant_token() -> None:
    ids = torch.arange(10)
    mask = torch.tensor([0, 0, 0, 0, 1, 1, 0, 0, 1, 1])
    assert prompt_of(ids, mask).tolist() == [0, 1, 2, 3]
    assert prompt_of(ids, torch.zeros(10, dtype=torch.long)) is None


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_decoding_is_lossless(toy_verifier, drafter_and_prompts, k: int) -> None:
    drafter, prompts = drafter_and_prompts
    assert len(prompts) == 3
    eos = toy_verifier.tokenizer.eos_token_id
    for prompt in prompts:
        reference = greedy_decode(toy_verifier, prompt, 24, eos)
        tokens, accepted = speculative_decode(drafter, toy_verifier, prompt, k, 24, eos)
        assert tokens == reference
        assert all(0 <= a <= k for a in accepted)
        # every step emits its accepted drafts plus one bonus token (the last step may be truncated)
        assert len(tokens) <= 1 + sum(a + 1 for a in accepted)


def test_lossless_when_the_drafter_is_always_right(toy_verifier, drafter_and_prompts) -> None:
    """A drafter fed the verifier's own greedy continuation: every draft is accepted, K+1 tokens per pass."""
    _, prompts = drafter_and_prompts
    k, n_new = 3, 13
    reference = greedy_decode(toy_verifier, prompts[0], n_new)
    prompt_len = len(prompts[0])

    class Oracle(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.anchor = torch.nn.Parameter(torch.zeros(1))

        def draft(self, hidden_states, input_ids, attention_mask=None, k=None):
            done = input_ids.shape[1] + 1 - prompt_len  # tokens generated so far
            ahead = reference[done : done + k]
            return torch.tensor([ahead + [0] * (k - len(ahead))])

    tokens, accepted = speculative_decode(Oracle(), toy_verifier, prompts[0], k, n_new)
    assert tokens == reference
    assert accepted == [k, k, k]  # 1 token from the prefill, then K+1 per pass: 1 + 4 + 4 + 4 = 13


def test_evaluate_reports_acceptance(toy_verifier, drafter_and_prompts) -> None:
    drafter, prompts = drafter_and_prompts
    result = evaluate(drafter, toy_verifier, prompts, k=2, max_new_tokens=12)
    assert result.num_prompts == 3 and len(result.tokens) == 3
    assert result.verifier_passes >= 1
    assert 1.0 <= result.acceptance_length <= 3.0
    rates = result.acceptance_rate_per_position
    assert len(rates) == 2 and rates[0] >= rates[1]
    # acceptance length is 1 + the sum of per-position acceptance rates (prefix acceptance)
    assert result.acceptance_length == pytest.approx(1 + sum(rates))
    assert drafter.training is False
    d = result.to_dict()
    assert "tokens" not in d and list(d) == [
        "acceptance_length", "acceptance_rate_per_position", "verifier_passes", "num_prompts", "num_generated_tokens"
    ]  # fmt: skip
