"""Acceptance-length evaluation: greedy speculative decoding of held-out prompts with drafter + verifier.

Each step the drafter proposes K tokens in one parallel pass, the verifier scores them in one pass, and the
longest prefix agreeing with the verifier's greedy choice is kept plus the verifier's bonus token, so the
output is exactly the verifier's own greedy decoding (speculation is lossless). `evaluate` runs the batched,
KV-cached engine (peagle_core.evaluation.speculate); `speculative_decode` (`evaluate(reference=True)`) is the
plain, one-prompt, full-recompute definition it is tested and benchmarked against.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from peagle_core.figures import Acceptance

if TYPE_CHECKING:
    from peagle_core.hidden_states.verifier import Verifier
    from peagle_core.model.drafter import PEagleDraftModel


def prompt_of(input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor | None:
    """A conversation's prompt: its tokens before the first trainable (assistant) token, or None if none."""
    first = (loss_mask > 0).nonzero()
    if len(first) == 0 or int(first[0]) == 0:
        return None
    return input_ids[: int(first[0])]


def held_out_prompts(dataset: Any, indices: Sequence[int], limit: int | None = None) -> list[torch.Tensor]:
    """Prompts of the samples `indices` of a PreparedDataset (samples without an assistant turn are skipped)."""
    prompts = []
    for i in indices:
        if limit is not None and len(prompts) >= limit:
            break
        prompt = prompt_of(*dataset[i])
        if prompt is not None:
            prompts.append(prompt)
    return prompts


def _argmax_logits(verifier: Verifier, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.tensor([ids], dtype=torch.long, device=verifier.device)
    logits, aux = verifier.logits(x)
    return logits[0].argmax(-1).cpu(), aux[0]


@torch.no_grad()
def greedy_decode(
    verifier: Verifier, prompt: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None
) -> list[int]:
    """Plain greedy decoding with the verifier alone (one pass per token): the reference output."""
    ids = prompt.tolist()
    out: list[int] = []
    while len(out) < max_new_tokens:
        nxt = int(_argmax_logits(verifier, ids)[0][-1])
        out.append(nxt)
        ids.append(nxt)
        if nxt == eos_token_id:
            break
    return out


@torch.no_grad()
def speculative_decode(
    drafter: PEagleDraftModel,
    verifier: Verifier,
    prompt: torch.Tensor,
    k: int,
    max_new_tokens: int,
    eos_token_id: int | None = None,
) -> tuple[list[int], list[int]]:
    """Greedy speculative decoding of one prompt: (generated tokens, accepted draft count per step).

    The drafter sees the aligned layout of docs/interfaces.md: hidden state of token t beside the input id
    of token t+1, so after a verifier pass over tokens 0..m-1 (last one the bonus, no hidden state yet)
    it drafts tokens m..m+k-1 from hidden 0..m-2 and ids 1..m-1.
    """
    device = next(drafter.parameters()).device
    ids = prompt.tolist()
    greedy, aux = _argmax_logits(verifier, ids)  # prefill: the verifier's first token
    ids.append(int(greedy[-1]))
    out, accepted = [ids[-1]], []
    while len(out) < max_new_tokens and out[-1] != eos_token_id:
        m = len(ids)
        hidden = aux[: m - 1].unsqueeze(0).to(device=device, dtype=next(drafter.parameters()).dtype)
        draft_ids = torch.tensor([ids[1:m]], dtype=torch.long, device=device)
        drafts = drafter.draft(hidden, draft_ids, k=k)[0].tolist()
        greedy, aux = _argmax_logits(verifier, ids + drafts)
        # greedy[m-1+j] is the verifier's choice for token m+j; drafts[j] is the drafter's.
        n_ok = 0
        while n_ok < k and drafts[n_ok] == int(greedy[m - 1 + n_ok]):
            n_ok += 1
        accepted.append(n_ok)
        new = [*drafts[:n_ok], int(greedy[m - 1 + n_ok])]
        if eos_token_id is not None and eos_token_id in new:
            new = new[: new.index(eos_token_id) + 1]
        new = new[: max_new_tokens - len(out)]
        out += new
        ids += new
    return out, accepted


def evaluate(
    drafter: PEagleDraftModel,
    verifier: Verifier,
    prompts: Sequence[torch.Tensor],
    k: int,
    max_new_tokens: int,
    eos_token_id: int | None = None,
    *,
    batch_size: int = 16,
    drafter_cache: bool = True,
    reference: bool = False,
) -> Acceptance:
    """Speculatively decode every prompt with K drafted tokens per step and summarise acceptance (mean
    tokens emitted per speculative verifier pass, accepted drafts + bonus), with the tokens generated.

    Batched and KV-cached (`peagle_core.evaluation.speculate`; `drafter_cache` False recomputes the
    drafter over each whole sequence). `reference` decodes one prompt at a time recomputing everything
    (`speculative_decode`), the definition the cached evaluator is tested and benchmarked against: the
    same tokens and acceptance either way.
    """
    from peagle_core.evaluation.speculate import speculative_decode_batch

    if k < 1:
        raise ValueError("k must be >= 1")
    with _eval_mode(drafter):
        if reference:
            decoded = [
                speculative_decode(drafter, verifier, p, k, max_new_tokens, eos_token_id) for p in prompts
            ]
        else:
            decoded = speculative_decode_batch(
                drafter, verifier, prompts, k, max_new_tokens, eos_token_id, batch_size, drafter_cache
            )
    return _summarise(k, decoded)


@contextmanager
def _eval_mode(drafter: PEagleDraftModel) -> Iterator[None]:
    was_training = drafter.training
    drafter.eval()
    try:
        yield
    finally:
        drafter.train(was_training)


def _summarise(k: int, decoded: Sequence[tuple[list[int], list[int]]]) -> Acceptance:
    """Acceptance over every step of every prompt, steps taken in prompt order."""
    outputs = [tokens for tokens, _ in decoded]
    steps = [a for _, accepted in decoded for a in accepted]
    n = len(steps)
    counts = torch.tensor(steps, dtype=torch.float64)
    rates = [float((counts > j).double().mean()) if n else 0.0 for j in range(k)]
    return Acceptance(
        acceptance_length=float((counts + 1).mean()) if n else 0.0,
        acceptance_rate_per_position=rates,
        verifier_passes=n,  # speculative passes, excluding each prompt's prefill
        num_prompts=len(decoded),
        num_generated_tokens=sum(len(t) for t in outputs),
        tokens=outputs,
    )
