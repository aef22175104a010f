"""The parts of a training run, built from a job spec: verifier, hidden-state source, drafter, teacher,
optimizer, the packed batches of each epoch and the vLLM judge (the data comes from `peagle_core.pipeline.stages`).

`peagle_core.training.loop` assembles them; benchmarks and tests build single parts with the same functions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from peagle_core.data import PreparedDataset
from peagle_core.data.packing import pack_bins
from peagle_core.errors import DataError
from peagle_core.evaluation.acceptance import held_out_prompts, prompt_of
from peagle_core.hidden_states.backends import cache_backend, make_source, open_backend, vllm_config_for
from peagle_core.hidden_states.build import build_cache
from peagle_core.hidden_states.cache import CACHE_MANIFEST, CacheFingerprint, HiddenStateCache
from peagle_core.hidden_states.loader import HiddenStateSource
from peagle_core.hidden_states.verifier import Verifier
from peagle_core.hidden_states.vllm_extract import VllmHiddenStates
from peagle_core.model.config import PEagleConfig
from peagle_core.model.drafter import PEagleDraftModel
from peagle_core.model.objective import Teacher
from peagle_core.model.precision import vllm_dtype
from peagle_core.serving.judge import Evaluators, VllmJudge, engine_options, resolve_evaluators
from peagle_core.spec import JobSpec
from peagle_core.training import distributed as dist_utils
from peagle_core.training.init_from import init_layer_ids, load_init_checkpoint
from peagle_core.training.muon import MuonAdamW


def load_verifier(spec: JobSpec, device: torch.device) -> Verifier:
    """The spec's verifier on `device`, capturing its aux layers."""
    return Verifier.load(
        spec.verifier.name_or_path,
        revision=spec.verifier.revision,
        dtype=spec.verifier.dtype,
        device=str(device),
        # A job that starts from a checkpoint feeds it the verifier layers it was trained on by default.
        layer_ids=spec.verifier.layer_ids or init_layer_ids(spec),
        trust_remote_code=spec.verifier.trust_remote_code,
    )


def build_source(
    spec: JobSpec, dataset: PreparedDataset, verifier: Verifier, cache_root: Path, info: dist_utils.DistInfo,
    should_stop: Callable[[], bool] | None = None, on_progress: Callable[[int, int], None] | None = None,
) -> HiddenStateSource:  # fmt: skip
    """The hidden-state source of `spec.hidden_states.mode`, computing with `spec.hidden_states.engine`; an
    offline job without a complete cache builds it first (StopRequested when `should_stop` ends the build;
    asked only in a single-process run, whose other ranks cannot be left waiting; `on_progress(done, total)`
    hears its tokens)."""
    fingerprint = CacheFingerprint.of(verifier, dataset)
    pad = verifier.tokenizer.pad_token_id or 0
    hs = spec.hidden_states
    cuda = verifier.device.type == "cuda"
    tokens = sum(int(n) for n in dataset.lengths)
    vllm = partial(VllmHiddenStates, vllm_config_for(spec, verifier.layer_ids, cuda=cuda, tokens=tokens))
    if hs.mode == "offline" and info.is_main:
        complete = (cache_root / CACHE_MANIFEST).is_file() and HiddenStateCache.open(
            cache_root, fingerprint
        ).is_complete()
        if not complete:
            with open_backend(
                cache_backend(cache_root, hs.engine), dataset,
                verifier_factory=lambda: verifier, vllm_factory=vllm, pad_token_id=pad,
            ) as backend:  # fmt: skip
                stop = should_stop if info.world_size == 1 else None
                build_cache(cache_root, dataset, backend, fingerprint, dtype=hs.dtype, should_stop=stop,
                            on_progress=on_progress)  # fmt: skip
    dist_utils.barrier(info)
    return make_source(
        hs.mode,
        dataset,
        backend=hs.engine,
        fingerprint=fingerprint,
        verifier_factory=lambda: verifier,
        vllm_factory=vllm,
        cache_dir=cache_root,
        dtype=hs.dtype,
        max_cache_bytes=hs.max_cache_bytes,
        keep_online=hs.keep_online,
        pad_token_id=pad,
    )


def build_model(spec: JobSpec, verifier: Any, dataset: Any, device: torch.device) -> PEagleDraftModel:
    """A fresh drafter shaped by the verifier, with the data's vocab map; embeddings (and lm_head) copied
    from the verifier as the spec asks, the lm_head frozen with `model.freeze_lm_head`. With `model.init_from`,
    the checkpoint's drafter instead."""
    if spec.model.init_from is not None:
        model = load_init_checkpoint(spec, verifier.config, list(verifier.layer_ids))
        model.lm_head.requires_grad_(not spec.model.freeze_lm_head)
        return model.to(device)
    config = PEagleConfig.from_verifier(
        verifier.config,
        **spec.model.drafter_settings(),
        draft_vocab_size=int(dataset.d2t.numel()),
        mask_token_id=dataset.mask_token_id,
        aux_layer_ids=list(verifier.layer_ids),
        verifier_name_or_path=spec.verifier.name_or_path,
    )
    model = PEagleDraftModel(config)
    model.set_vocab_map(dataset.t2d, dataset.d2t)
    if spec.model.init_embeddings_from_verifier:
        model.init_embeddings(verifier.embed_weight.detach().float().cpu())
    if spec.model.init_lm_head_from_verifier:
        model.init_lm_head(verifier.lm_head_weight)
    model.lm_head.requires_grad_(not spec.model.freeze_lm_head)
    return model.to(device)


def build_teacher(verifier: Any, model: PEagleDraftModel, *, keep_full_lm_head: bool = False) -> Teacher:
    """The verifier's frozen final norm and lm_head rows over `model`'s draft vocabulary, on its device
    (and the whole lm_head with `keep_full_lm_head`, for `training.in_vocab_targets_only`)."""
    teacher = Teacher.from_verifier(
        verifier.final_norm,
        verifier.lm_head_weight,
        model.verifier_ids(),
        keep_full_lm_head=keep_full_lm_head,
    )
    return teacher.to(model.verifier_ids().device)


def build_optimizer(
    model: torch.nn.Module, lr: float, weight_decay: float, kind: str = "adamw"
) -> torch.optim.Optimizer:
    """AdamW (or `kind="muon"`: Muon for the decoder's weight matrices, AdamW for the rest) with weight
    decay on matrices only: norms, biases and `mask_hidden` are not decayed."""
    decay, no_decay, matrices = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or "norm" in name or name.endswith("bias") or name == "mask_hidden":
            no_decay.append(p)
        elif kind == "muon" and p.ndim == 2 and "embed_tokens" not in name and "lm_head" not in name:
            matrices.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if kind == "muon":
        return MuonAdamW([{"params": matrices, "weight_decay": weight_decay}], groups, lr=lr)
    if kind != "adamw":
        raise ValueError(f"unknown optimizer {kind!r} (adamw or muon)")
    # The fused kernel updates each tensor in one pass (CPU: 0.03 s against 0.15 s per step at SmolLM2's
    # drafter shape), FSDP's sharded parameters (DTensors) included, so every world size steps alike.
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=True)


def global_batch_bins(spec: JobSpec) -> int:
    """Packed rows per optimizer step, over all ranks: grad_accum x the world size the job asked for
    (`resources.gpus` x the most machines, `nominal_world_size`).

    Fixed by the spec, not by how many ranks run it, so the optimizer trajectory (and a checkpoint's data
    position) is the same at any world size.
    """
    return spec.training.grad_accum * spec.resources.nominal_world_size


def epoch_bins(train_indices: list[int], lengths: list[int], spec: JobSpec, epoch: int) -> list[list[int]]:
    """The packed rows of `epoch` as lists of dataset indices, in the one order every world size shares."""
    tc = spec.training
    sub_lengths = [lengths[i] for i in train_indices]
    bins = pack_bins(sub_lengths, tc.total_seq_len, tc.seed, epoch)
    return [[train_indices[j] for j in b] for b in bins]


def count_steps(spec: JobSpec, train_idx: list[int], lengths: list[int]) -> int:
    """Optimizer steps of the whole run: every epoch's rows in groups of `global_batch_bins`, capped."""
    tc = spec.training
    per_step = global_batch_bins(spec)
    total = sum(math.ceil(len(epoch_bins(train_idx, lengths, spec, e)) / per_step) for e in range(tc.epochs))
    if tc.max_steps is not None:
        total = min(total, tc.max_steps)
    if total == 0:
        raise DataError("the dataset packs into no training batches", param="dataset")
    return total


def heldout_prompt_tokens(
    spec: JobSpec, dataset: PreparedDataset, val_idx: list[int], verifier: Verifier
) -> list[torch.Tensor]:
    """Held-out prompts: the validation split's (count given), or the spec's own prompt strings."""
    prompts = spec.evaluation.prompts
    if isinstance(prompts, int):
        return held_out_prompts(dataset, val_idx, limit=prompts)
    tok = verifier.tokenizer
    out = []
    for item in prompts:
        text = item if isinstance(item, str) else item.prompt
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        out.append(torch.tensor(ids, dtype=torch.long))
    return out


def eval_categories(spec: JobSpec, dataset: PreparedDataset, val_idx: list[int]) -> list[str | None]:
    """The category of each of `heldout_prompt_tokens`' prompts (None where it has none): the spec's own, or the
    dataset rows' where the prepared dataset keeps them (an optional `categories` list per sample)."""
    prompts = spec.evaluation.prompts
    if not isinstance(prompts, int):
        return [None if isinstance(p, str) else p.category for p in prompts]
    per_sample = getattr(dataset, "categories", None)
    out: list[str | None] = []
    for i in val_idx:  # the samples held_out_prompts keeps, in its order
        if len(out) >= prompts:
            break
        if prompt_of(*dataset[i]) is not None:
            out.append(per_sample[i] if per_sample is not None else None)
    return out


def build_judge(
    spec: JobSpec,
    prompts: list[torch.Tensor],
    device: torch.device,
    *,
    is_main: bool,
    categories: list[str | None] | None = None,
) -> tuple[Evaluators, VllmJudge | None]:
    """Which evaluators evaluate and gate this run, and the vLLM judge when one is needed (main rank only; it
    starts its engine on first use). Without evaluation prompts there is nothing for vLLM to check with."""
    evaluators = resolve_evaluators(spec)
    if not prompts:
        evaluators = Evaluators(
            ours=evaluators.ours, vllm=False, gate_off_reason="no evaluation prompts to check with"
        )
    if not (evaluators.needs_vllm and is_main):
        return evaluators, None
    judge = VllmJudge(
        spec.verifier.name_or_path,
        [p.tolist() for p in prompts],
        spec.evaluation.max_new_tokens,
        revision=spec.verifier.revision,
        trust_remote_code=spec.verifier.trust_remote_code,
        options=engine_options(device, spec.verifier.dtype),
        categories=categories,
        # Speed-ups are timed in the dtype users serve: bf16 where it is fast, unless the spec names one.
        timing_dtype=vllm_dtype(spec.verifier.dtype, device),
    )
    return evaluators, judge
