"""The P-EAGLE training loop: data → hidden states → drafter → AdamW steps with checkpoints, eval and export.

Reads top to bottom like nanoGPT: `train()` resolves the spec, prepares the data and the hidden-state
source, builds the drafter from the verifier, then runs the loop. Under torchrun it trains data-parallel.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch.nn.parallel import DistributedDataParallel

from peagle_core import distributed as dist_utils
from peagle_core.checkpoint import (
    DataPosition,
    capture_rng,
    latest_checkpoint,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from peagle_core.errors import CheckpointError, DataError
from peagle_core.evaluate import evaluate, held_out_prompts
from peagle_core.export import export_checkpoint, validate_checkpoint
from peagle_core.io import atomic_write_json
from peagle_core.partition import partitioned_backward
from peagle_core.schedule import build_scheduler
from peagle_core.spec import JobSpec

MetricsFn = Callable[[dict[str, Any]], None]
EventFn = Callable[[str, str, dict[str, Any]], None]


@dataclass
class TrainResult:
    status: Literal["completed", "stopped"]
    step: int
    checkpoint_dir: Path | None
    export_dir: Path | None
    metrics: dict[str, Any] = field(default_factory=dict)
    model: Any = field(default=None, repr=False)  # the trained drafter (this rank's copy)


# ------------------------------------------------------------------------------------------------ setup


def prepare_data(spec: JobSpec, out_dir: Path, dataset_dir: str | Path | None, info: dist_utils.DistInfo):
    """The prepared dataset: `dataset_dir` if given, else out_dir/data (reused when its fingerprint matches)."""
    from peagle_core.data import PreparedDataset
    from peagle_core.data.prepare import prepare_for_spec

    if dataset_dir is not None:
        return PreparedDataset.open(dataset_dir)
    if spec.dataset.path is None:
        raise DataError(
            "dataset.id needs the service to resolve it to a file; give dataset.path", param="dataset"
        )
    target = out_dir / "data"
    if info.is_main:
        prepare_for_spec(spec, spec.dataset.path, target)
    dist_utils.barrier(info)
    return PreparedDataset.open(target)


def load_verifier(spec: JobSpec, device: torch.device):
    from peagle_core.verifier import Verifier

    return Verifier.load(
        spec.verifier.name_or_path,
        revision=spec.verifier.revision,
        dtype=spec.verifier.dtype,
        device=str(device),
        layer_ids=spec.verifier.layer_ids,
        trust_remote_code=spec.verifier.trust_remote_code,
    )


def build_source(spec: JobSpec, dataset: Any, verifier: Any, cache_root: Path, info: dist_utils.DistInfo):
    """The hidden-state source of `spec.hidden_states.mode`; an offline job without a cache builds it first."""
    from peagle_core.cache import MANIFEST, CacheFingerprint, HiddenStateCache, build_cache
    from peagle_core.hidden_states import VerifierCompute, make_source

    fingerprint = CacheFingerprint.of(verifier, dataset)
    pad = verifier.tokenizer.pad_token_id or 0
    hs = spec.hidden_states
    if hs.mode == "offline" and info.is_main:
        complete = (cache_root / MANIFEST).is_file() and HiddenStateCache.open(
            cache_root, fingerprint
        ).is_complete()
        if not complete:
            compute = VerifierCompute(dataset, lambda: verifier, pad_token_id=pad)
            build_cache(cache_root, dataset, compute, fingerprint, dtype=hs.dtype)
    dist_utils.barrier(info)
    return make_source(
        hs.mode,
        dataset,
        verifier_factory=lambda: verifier,
        cache_dir=cache_root,
        dtype=hs.dtype,
        max_cache_bytes=hs.max_cache_bytes,
        fingerprint=fingerprint,
        pad_token_id=pad,
    )


def build_model(spec: JobSpec, verifier: Any, dataset: Any, device: torch.device):
    """A fresh drafter shaped by the verifier: embeddings (and lm_head) copied from it, its frozen head, the vocab map."""
    from peagle_core.model import PEagleConfig, PEagleDraftModel

    m = spec.model
    config = PEagleConfig.from_verifier(
        verifier.config,
        num_layers=m.num_layers,
        num_depths=m.num_depths,
        down_sample_ratio=m.down_sample_ratio,
        down_sample_ratio_min=m.down_sample_ratio_min,
        max_anchors=m.max_anchors,
        draft_vocab_size=int(dataset.d2t.numel()),
        mask_token_id=dataset.mask_token_id,
        aux_layer_ids=list(verifier.layer_ids),
        norm_before_residual=m.norm_before_residual,
        verifier_name_or_path=spec.verifier.name_or_path,
        verifier_architectures=list(getattr(verifier.config, "architectures", None) or []),
    )
    model = PEagleDraftModel(config)
    if m.init_embeddings_from_verifier:
        model.init_embeddings(verifier.embed_weight.detach().float().cpu())
    model.load_verifier_head(
        verifier.final_norm,
        verifier.lm_head_weight,
        dataset.t2d,
        dataset.d2t,
        init_lm_head=m.init_lm_head_from_verifier,
    )
    return model.to(device)


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only: norms, biases and `mask_hidden` are not decayed."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or "norm" in name or name.endswith("bias") or name == "mask_hidden":
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=False)


def epoch_bins(
    train_indices: list[int], lengths: list[int], spec: JobSpec, epoch: int, info: dist_utils.DistInfo
):
    """This rank's packed batches for `epoch`, as lists of dataset indices (equal counts on every rank)."""
    from peagle_core.data.packing import pack_bins

    tc = spec.training
    sub_lengths = [lengths[i] for i in train_indices]
    bins = pack_bins(
        sub_lengths, tc.total_seq_len, tc.seed, epoch, rank=info.rank, world_size=info.world_size
    )
    return [[train_indices[j] for j in b] for b in bins]


# ------------------------------------------------------------------------------------------- one step


def forward_backward(
    model: torch.nn.Module,
    batch: Any,
    *,
    num_segments: int,
    generator: torch.Generator,
    scale: float,
    autocast: torch.autocast | None = None,
) -> dict[str, torch.Tensor]:
    """Loss + backward for one packed batch (in `num_segments` sequence partitions when > 1).

    Gradients accumulate in `.grad` scaled by `scale`; returns the batch's metrics as tensors (no host sync).
    """
    with autocast if autocast is not None else _null():
        return partitioned_backward(model, batch, num_segments, generator=generator, scale=scale)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# ------------------------------------------------------------------------------------------ the loop


def train(
    spec: JobSpec,
    out_dir: str | Path,
    *,
    on_metrics: MetricsFn | None = None,
    should_stop: Callable[[], bool] | None = None,
    resume: bool = True,
    dataset_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
    on_event: EventFn | None = None,
) -> TrainResult:
    """Train a drafter as `spec` says, writing checkpoints and the final export under `out_dir`."""
    info = dist_utils.init_distributed()
    try:
        return _train(
            spec, Path(out_dir), info, on_metrics, should_stop, resume, dataset_dir, cache_dir, on_event
        )
    finally:
        dist_utils.shutdown()


def _train(
    spec: JobSpec,
    out_dir: Path,
    info: dist_utils.DistInfo,
    on_metrics: MetricsFn | None,
    should_stop: Callable[[], bool] | None,
    resume: bool,
    dataset_dir: str | Path | None,
    cache_dir: str | Path | None,
    on_event: EventFn | None,
) -> TrainResult:
    from peagle_core.hidden_states import BatchLoader

    tc = spec.training
    device = dist_utils.device_for(info)

    def event(kind: str, message: str, **data: Any) -> None:
        if on_event is not None and info.is_main:
            on_event(kind, message, data)

    def report(metrics: dict[str, Any]) -> None:
        if on_metrics is not None and info.is_main:
            on_metrics(metrics)

    # --- data and hidden states
    event("prepare", "preparing the dataset")
    dataset = prepare_data(spec, out_dir, dataset_dir, info)
    train_idx, val_idx = dataset.split(spec.dataset.val_fraction, tc.seed)
    if not train_idx:
        raise DataError("no training samples left after the validation split", param="dataset.val_fraction")
    event("prepare", "dataset ready", samples=len(dataset), train=len(train_idx), val=len(val_idx))

    verifier = load_verifier(spec, device)
    cache_root = Path(cache_dir or spec.hidden_states.cache_uri or out_dir / "cache")
    event("hidden_states", f"hidden states: {spec.hidden_states.mode}", cache_dir=str(cache_root))
    source = build_source(spec, dataset, verifier, cache_root, info)

    # --- model, optimizer, schedule
    torch.manual_seed(tc.seed)
    model = build_model(spec, verifier, dataset, device)
    optimizer = build_optimizer(model, tc.lr, tc.weight_decay)
    lengths = list(dataset.lengths)
    micro_per_epoch = [len(epoch_bins(train_idx, lengths, spec, e, info)) for e in range(tc.epochs)]
    total_steps = sum(math.ceil(n / tc.grad_accum) for n in micro_per_epoch)
    if tc.max_steps is not None:
        total_steps = min(total_steps, tc.max_steps)
    if total_steps == 0:
        raise DataError("the dataset packs into no training batches", param="dataset")
    scheduler = build_scheduler(
        optimizer,
        warmup_steps=math.ceil(tc.warmup_ratio * total_steps),
        total_steps=total_steps,
        min_lr_ratio=tc.min_lr_ratio,
    )
    cod_generator = torch.Generator().manual_seed(tc.seed * 1_000_003 + info.rank)

    # --- resume
    ckpt_root = out_dir / "checkpoints"
    position = DataPosition(step=0, epoch=0, batch_index=0)
    latest = latest_checkpoint(ckpt_root) if resume else None
    if latest is not None:
        state = load_checkpoint(latest)
        model.load_state_dict(state.weights)
        optimizer.load_state_dict(state.optimizer)
        scheduler.load_state_dict(state.scheduler)
        rngs = state.rng["ranks"]
        if len(rngs) != info.world_size:
            raise CheckpointError(
                [f"checkpoint was written by {len(rngs)} ranks, this run has {info.world_size}"],
                path=str(latest),
            )
        restore_rng(rngs[info.rank], cod_generator)
        position = state.position
        event("train", f"resumed from {latest.name}", step=position.step)

    ddp_model = DistributedDataParallel(model) if info.enabled else model
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None
    eval_ks = spec.speculative_tokens
    prompts = _eval_prompts(spec, dataset, val_idx, verifier)

    def run_eval(step: int) -> dict[str, Any]:
        if not info.is_main or not prompts:
            return {}
        event("eval", f"evaluating at step {step}", prompts=len(prompts))
        results = {}
        for k in eval_ks:
            r = evaluate(
                model, verifier, prompts, k, spec.evaluation.max_new_tokens, verifier.tokenizer.eos_token_id
            )
            results[f"k={k}"] = r.to_dict()
            report({"step": step, f"eval/acceptance_length@{k}": r.acceptance_length})
        return {"step": step, "results": results}

    def checkpoint(step: int, epoch: int, batch_index: int, metrics: dict, eval_result: dict | None) -> Path:
        rngs = dist_utils.all_gather_tensors_state(capture_rng(cod_generator), info)
        path = None
        if info.is_main:
            path = save_checkpoint(
                ckpt_root,
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                position=DataPosition(step=step, epoch=epoch, batch_index=batch_index),
                rng={"ranks": rngs},
                metrics=metrics,
                extra_json={"eval.json": eval_result} if eval_result else None,
            )
        dist_utils.barrier(info)
        return path or ckpt_root / f"step_{step:08d}"

    # --- the loop
    event("train", "training", total_steps=total_steps, world_size=info.world_size)
    model.train()
    step, status = position.step, "completed"
    last_metrics: dict[str, Any] = {}
    last_ckpt: Path | None = latest
    last_eval: dict[str, Any] | None = None
    t_start, tokens_seen = time.monotonic(), 0
    epoch = position.epoch
    run_start = counters = source_counters(source)
    while step < total_steps and epoch < tc.epochs:
        bins = epoch_bins(train_idx, lengths, spec, epoch, info)
        first = position.batch_index if epoch == position.epoch else 0
        loader = BatchLoader(dataset, source, bins, total_seq_len=tc.total_seq_len, start=first)
        micro, sums, step_tokens, t_step = 0, {}, 0, time.monotonic()
        batch_index = first
        for batch in loader:
            batch = batch.to(device)
            batch_index += 1
            micro += 1
            last_micro = micro == tc.grad_accum or batch_index == len(bins)
            # Only the last micro-batch of a step all-reduces gradients.
            sync = ddp_model.no_sync() if info.enabled and not last_micro else _null()
            with sync:
                batch_metrics = forward_backward(
                    ddp_model,
                    batch,
                    num_segments=tc.num_segments,
                    generator=cod_generator,
                    scale=1.0 / tc.grad_accum,
                    autocast=autocast,
                )
            for k, v in batch_metrics.items():
                sums[k] = sums.get(k, 0) + v
            step_tokens += int(batch.num_tokens)
            if not last_micro:
                continue

            # --- optimizer step
            if micro < tc.grad_accum:  # a short final accumulation: rescale to a mean over what we saw
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(tc.grad_accum / micro)
            if tc.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            step += 1

            metrics = _step_metrics(sums, micro, info, device)
            tokens_seen += step_tokens * info.world_size
            elapsed = time.monotonic() - t_step
            done = step - position.step
            metrics.update(
                step=step,
                total_steps=total_steps,
                epoch=epoch,
                lr=lr,
                tokens_per_s=step_tokens * info.world_size / max(elapsed, 1e-9),
                eta_s=(time.monotonic() - t_start) / done * (total_steps - step),
            )
            report(metrics)
            last_metrics = metrics
            micro, sums, step_tokens, t_step = 0, {}, 0, time.monotonic()

            stop = dist_utils.any_rank(bool(should_stop and should_stop()), info, device)
            finished = step >= total_steps
            eval_now = (tc.eval_every_steps and step % tc.eval_every_steps == 0) or finished
            eval_result = run_eval(step) if eval_now else None
            if eval_result:
                last_eval = eval_result
            if stop or finished or step % tc.checkpoint_every_steps == 0:
                at_end = batch_index == len(bins)
                last_ckpt = checkpoint(
                    step, epoch + 1 if at_end else epoch, 0 if at_end else batch_index, metrics, eval_result
                )
            if stop:
                status = "stopped"
                break
            if finished:
                break
        if status == "stopped":
            break
        # The loader has been joined by now (the `for` dropped it), so the counters are final.
        now = source_counters(source)
        epoch_stats = sum_across_ranks(counters_delta(now, counters), info, device)
        counters = now
        event(
            "epoch",
            f"epoch {epoch} done: {epoch_stats['verifier_calls']} verifier calls, "
            f"{epoch_stats['cache_hits']} cache hits",
            epoch=epoch,
            complete=batch_index == len(bins),
            step=step,
            **epoch_stats,
        )
        if step >= total_steps:
            break
        epoch += 1
    source.close()  # a hybrid run that ended mid-epoch still keeps what it computed
    totals = sum_across_ranks(counters_delta(source_counters(source), run_start), info, device)

    if status == "stopped":
        event("train", f"stopped at step {step}", step=step)
        return TrainResult("stopped", step, last_ckpt, None, {**last_metrics, **totals}, model)

    # --- final export
    export_dir = None
    if last_eval is None:  # resumed from the final checkpoint: its evaluation is not in memory
        last_eval = run_eval(step)
    if info.is_main:
        event("export", "exporting the drafter", step=step)
        export_dir = out_dir / "export" / f"step_{step}"
        summary = {**_eval_summary(last_eval), "train/loss": last_metrics.get("loss")}
        export_checkpoint(
            model,
            export_dir,
            verifier_name_or_path=spec.verifier.name_or_path,
            data_fingerprint=dataset.fingerprint,
            metrics={k: v for k, v in summary.items() if v is not None},
            speculative_tokens=max(eval_ks),
        )
        problems = validate_checkpoint(export_dir, verifier.config)
        if problems:
            raise CheckpointError(problems, path=str(export_dir))
        atomic_write_json(export_dir / "eval.json", last_eval or {})
    dist_utils.barrier(info)
    final = {**last_metrics, **_eval_summary(last_eval), **totals}
    return TrainResult("completed", step, last_ckpt, export_dir, final, model)


COUNTERS = ("verifier_calls", "cache_hits", "cache_misses")


def source_counters(source: Any) -> dict[str, int]:
    """The hidden-state source's running counters under one naming for every mode.

    A cache miss is a sample the hybrid source computed; offline reads count as hits.
    """
    stats = source.stats()
    return {
        "verifier_calls": int(stats.get("verifier_calls", 0)),
        "cache_hits": int(stats.get("cache_hits", stats.get("cache_reads", 0))),
        "cache_misses": int(stats.get("computed", 0)),
    }


def counters_delta(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: now[k] - before[k] for k in COUNTERS}


def sum_across_ranks(
    counts: dict[str, int], info: dist_utils.DistInfo, device: torch.device
) -> dict[str, int]:
    """Every rank's counters added up (each rank has its own source); a collective, so all ranks call it."""
    if not info.enabled:
        return counts
    t = torch.tensor([float(counts[k]) for k in COUNTERS], dtype=torch.float64, device=device)
    total = dist_utils.mean_across_ranks(t, info) * info.world_size
    return {k: round(v) for k, v in zip(COUNTERS, total.tolist(), strict=True)}


def _step_metrics(
    sums: dict[str, torch.Tensor], micro: int, info: dist_utils.DistInfo, device: torch.device
) -> dict[str, Any]:
    """Mean over micro-batches (and ranks) of the accumulated metric tensors, pulled to the host once."""
    keys = sorted(sums)
    packed = torch.stack([torch.as_tensor(sums[k], dtype=torch.float32).to(device) for k in keys]) / micro
    packed = dist_utils.mean_across_ranks(packed, info)
    values = packed.tolist()  # the step's single host sync
    return {k: (round(v) if k.startswith("positions_") else v) for k, v in zip(keys, values, strict=True)}


def _eval_summary(eval_result: dict[str, Any] | None) -> dict[str, float]:
    if not eval_result:
        return {}
    return {
        f"eval/acceptance_length@{r['k']}": r["acceptance_length"]
        for r in eval_result.get("results", {}).values()
    }


def _eval_prompts(spec: JobSpec, dataset: Any, val_idx: list[int], verifier: Any) -> list[torch.Tensor]:
    """Held-out prompts: the validation split's (count given), or the spec's own prompt strings."""
    prompts = spec.evaluation.prompts
    if isinstance(prompts, int):
        return held_out_prompts(dataset, val_idx, limit=prompts)
    tok = verifier.tokenizer
    out = []
    for text in prompts:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        out.append(torch.tensor(ids, dtype=torch.long))
    return out
