"""The P-EAGLE training loop: data → hidden states → drafter → AdamW steps with checkpoints, eval and export.

`train()` reads like torchtitan's trainer in miniature: `setup` builds everything once (data, hidden-state
source, drafter, teacher, optimizer, resume point), then each loop iteration calls `train_step`,
`maybe_evaluate` and `maybe_checkpoint`, and the end exports the drafter. Under torchrun it trains
data-parallel (DDP or FSDP2, `training.sharding`); a step's rows, gradient and randomness do not depend on
how many ranks run it, so a checkpoint resumes at any world size.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from peagle_core.data import PreparedDataset
from peagle_core.data.packing import StepShard, step_shards
from peagle_core.errors import DataError, TrainingDiverged
from peagle_core.evaluation.acceptance import EvalResult, evaluate
from peagle_core.evaluation.report import AcceptanceFigures, EvaluationReport, KResult
from peagle_core.events import CallbackReporter, Event, Level, Reporter
from peagle_core.hidden_states.loader import BatchLoader, HiddenStateSource
from peagle_core.hidden_states.verifier import Verifier
from peagle_core.io import atomic_write_json
from peagle_core.model.drafter import PEagleDraftModel
from peagle_core.model.objective import Objective, Teacher
from peagle_core.model.partition import partitioned_backward
from peagle_core.model.precision import resolve_precision
from peagle_core.serving.categories import category_groups, eval_categories_figures, pool_eval
from peagle_core.serving.export import export_checkpoint
from peagle_core.serving.gate import Acceptance, ServingCheck
from peagle_core.serving.judge import (
    GAP_TOLERANCE,
    Engines,
    VllmJudge,
    agreement_gap,
)
from peagle_core.serving.recommendation import ServingRecommendation
from peagle_core.spec import JobSpec
from peagle_core.training import distributed as dist_utils
from peagle_core.training import sharding
from peagle_core.training.builders import (
    build_judge,
    build_model,
    build_optimizer,
    build_source,
    build_teacher,
    count_steps,
    epoch_bins,
    eval_categories,
    eval_prompts,
    global_batch_bins,
    load_verifier,
)
from peagle_core.training.cpu_runtime import keep_freed_memory, trim_freed_memory
from peagle_core.training.result import PipelineResult
from peagle_core.training.resume import (
    DataPosition,
    TrainingState,
    restore_latest,
    save_checkpoint,
)
from peagle_core.training.schedule import build_scheduler

ConsumedFn = Callable[[int, list[int]], None]


@dataclass
class Hooks:
    """The caller's callbacks: only rank 0 tells `reporter` its events and metrics; a stop request stops every
    rank; `on_consumed(epoch, sample_ids)` hears, on every rank, the dataset samples each step trained that rank on."""

    info: dist_utils.DistInfo
    reporter: Reporter = field(default_factory=CallbackReporter)
    should_stop: Callable[[], bool] | None = None
    on_consumed: ConsumedFn | None = None

    def event(self, kind: str, message: str, /, *, level: Level = "info", **data: Any) -> None:
        if self.info.is_main:
            self.reporter.on_event(Event(kind, message, data, level))

    def report(self, metrics: dict[str, Any]) -> None:
        if self.info.is_main:
            self.reporter.on_metrics(metrics)

    def consumed(self, epoch: int, sample_ids: list[int]) -> None:
        if self.on_consumed is not None:
            self.on_consumed(epoch, sample_ids)

    def stop_requested(self, device: torch.device) -> bool:
        """A collective: every rank calls it and gets the same answer."""
        return dist_utils.any_rank(bool(self.should_stop and self.should_stop()), self.info, device)


@dataclass
class Trainer:
    """What `setup` builds and the loop reads."""

    spec: JobSpec
    out_dir: Path
    info: dist_utils.DistInfo
    device: torch.device
    hooks: Hooks
    dataset: PreparedDataset
    train_idx: list[int]
    verifier: Verifier
    source: HiddenStateSource
    model: PEagleDraftModel  # sharded in place under FSDP (`sharding.full_model` gathers it whole)
    train_module: torch.nn.Module  # what forward/backward run through: the drafter, or its DDP wrapper
    teacher: Teacher
    objective: Objective  # how rows score: `training.depth_weights`, `tv_weight`, `in_vocab_targets_only`
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    autocast: Any  # bf16 autocast under `training.precision` bf16, None for fp32
    precision: str  # what `training.precision` resolved to on this device
    total_steps: int
    prompts: list[torch.Tensor]
    ckpt_root: Path  # training checkpoints (the export goes to out_dir/export)
    # Who measures acceptance length and whether the vLLM publish gate runs (`setup` resolves the spec's).
    engines: Engines = field(
        default_factory=lambda: Engines(ours=True, vllm=False, gate_off_reason="no serving check configured")
    )
    judge: VllmJudge | None = None  # vLLM on the evaluation prompts (rank 0, when `engines` needs it)
    prompt_categories: list[str | None] = field(default_factory=list)  # per prompt, where they have one


@dataclass
class Progress:
    """Where the loop stands: what a checkpoint records and the result reports."""

    step: int = 0
    epoch: int = 0
    bins_done: int = 0  # the epoch's packed rows consumed so far, over all ranks
    metrics: dict[str, Any] = field(default_factory=dict)  # the last step's
    checkpoint: Path | None = None  # the newest training checkpoint
    evaluation: EvaluationReport | None = None  # the last evaluation's
    stopped: bool = False
    nonfinite_steps: int = 0  # consecutive steps whose loss or gradient norm was NaN/infinite

    @classmethod
    def resumed(cls, state: TrainingState | None) -> Progress:
        """Progress at a restored checkpoint's data position (the start when there is none)."""
        if state is None:
            return cls()
        at = state.position
        return cls(step=at.step, epoch=at.epoch, bins_done=at.bins_done, checkpoint=state.path)

    def running(self, total_steps: int) -> bool:
        return not self.stopped and self.step < total_steps

    def advance(self, step_bins: int) -> None:
        """One optimizer step over `step_bins` packed rows (all ranks together) is done."""
        self.step += 1
        self.bins_done += step_bins


# ------------------------------------------------------------------------------------------------ train


def train(
    spec: JobSpec,
    out_dir: str | Path,
    *,
    reporter: Reporter | None = None,
    should_stop: Callable[[], bool] | None = None,
    resume: bool = True,
    dataset_dir: str | Path,
    cache_dir: str | Path | None = None,
    on_consumed: ConsumedFn | None = None,
) -> PipelineResult:
    """The training stage: train a drafter as `spec` says on the prepared dataset at `dataset_dir`, writing
    checkpoints and the final export under `out_dir`; rank 0 tells `reporter` its events and metrics.
    `peagle_core.pipeline.stages.run_pipeline` runs the whole job (regeneration and data preparation first)."""
    info = dist_utils.init_distributed()
    hooks = Hooks(info, reporter or CallbackReporter(), should_stop=should_stop, on_consumed=on_consumed)
    run = None
    try:
        run, progress = setup(
            spec, Path(out_dir), info, hooks, resume=resume, dataset_dir=dataset_dir, cache_dir=cache_dir
        )
        result = _train(run, progress)
        # gloo frees a finished collective on its own thread, which needs the GIL for the tensors it holds;
        # a teardown that starts first (it holds the GIL while joining that thread) deadlocks. The barrier
        # waits with the GIL released until every earlier collective is done and freed.
        dist_utils.barrier(info)
        return result
    finally:
        if run is not None and run.judge is not None:
            run.judge.close()
        run = None  # the DDP/FSDP wrappers go before the process group (`dist_utils.shutdown`)
        dist_utils.shutdown()


def _train(run: Trainer, progress: Progress) -> PipelineResult:
    """The loop: optimizer steps with evaluation and checkpoints until done or stopped, then the export."""
    spec, tc, hooks = run.spec, run.spec.training, run.hooks
    hooks.event("train", "training", total_steps=run.total_steps, world_size=run.info.world_size)
    run.model.train()
    counters = run_start = run.source.counters()
    started, first_step = time.monotonic(), progress.step
    rows_per_step, info = global_batch_bins(spec), run.info
    while progress.running(run.total_steps) and progress.epoch < tc.epochs:
        bins = epoch_bins(run.train_idx, list(run.dataset.lengths), spec, progress.epoch)
        shards = step_shards(len(bins), progress.bins_done, rows_per_step, info.rank, info.world_size)
        rows = [bins[b] for shard in shards for b in shard.bins]
        loader = BatchLoader(run.dataset, run.source, rows, total_seq_len=tc.total_seq_len)
        with contextlib.closing(iter(loader)) as batches:
            for shard in shards:
                if not progress.running(run.total_steps):
                    break
                metrics = train_step(run, batches, shard, epoch=progress.epoch)
                if run.device.type == "cpu":
                    trim_freed_memory()  # the kept heap fragments as step shapes vary
                hooks.consumed(progress.epoch, [i for b in shard.consumed for i in bins[b]])
                progress.advance(shard.step_bins)
                progress.nonfinite_steps = 0 if _finite(metrics) else progress.nonfinite_steps + 1
                per_step = (time.monotonic() - started) / (progress.step - first_step)
                eta_s = per_step * (run.total_steps - progress.step)
                progress.metrics = {**metrics, "step": progress.step, "total_steps": run.total_steps,
                                    "epoch": progress.epoch, "eta_s": eta_s}  # fmt: skip
                hooks.report(progress.metrics)
                check_divergence(run, progress)
                progress.stopped = hooks.stop_requested(run.device)
                evaluation = maybe_evaluate(run, progress)
                maybe_checkpoint(run, progress, evaluation, epoch_len=len(bins))
        # Closing the loader joined its thread, so the source's counters are final for this epoch.
        if not progress.stopped:
            counters = end_epoch(run, progress, epoch_len=len(bins), counters=counters)
    run.source.close()  # a hybrid run that ended mid-epoch still keeps what it computed
    totals = dist_utils.sum_across_ranks(_delta(run.source.counters(), run_start), run.info, run.device)

    whole = sharding.full_model(run.model, run.info)  # a collective under FSDP
    result = PipelineResult(
        "stopped", progress.step, progress.checkpoint, model=whole if whole is not None else run.model
    )
    if progress.stopped:
        hooks.event("stopped", f"stopped at step {progress.step}", step=progress.step)
        result.metrics = {**progress.metrics, **totals}
    else:
        result.status = "completed"
        result.export_dir, result.evaluation, result.serving = export_drafter(run, progress, whole)
        result.metrics = {**progress.metrics, **_eval_summary(progress.evaluation), **totals}
    return result


# ------------------------------------------------------------------------------------------------ setup


def setup(
    spec: JobSpec,
    out_dir: Path,
    info: dist_utils.DistInfo,
    hooks: Hooks,
    *,
    resume: bool,
    dataset_dir: str | Path,
    cache_dir: str | Path | None,
) -> tuple[Trainer, Progress]:
    """Data, hidden states, drafter, teacher, optimizer and schedule; restored from the newest checkpoint
    under `out_dir` when `resume` finds one."""
    tc = spec.training
    device = dist_utils.device_for(info)
    if device.type == "cpu":
        keep_freed_memory()
    dataset = PreparedDataset.open(dataset_dir)  # the pipeline's prepare stage made it
    train_idx, val_idx = dataset.split(spec.dataset.val_fraction, tc.seed)
    if not train_idx:
        raise DataError("no training samples left after the validation split", param="dataset.val_fraction")
    hooks.event("data", "dataset ready", samples=len(dataset), train=len(train_idx), val=len(val_idx))

    verifier = load_verifier(spec, device)
    cache_root = Path(cache_dir or spec.hidden_states.cache_uri or out_dir / "cache")
    hooks.event("hidden_states", f"hidden states: {spec.hidden_states.mode}", cache_dir=str(cache_root))
    source = build_source(spec, dataset, verifier, cache_root, info)

    torch.manual_seed(tc.seed)
    model = build_model(spec, verifier, dataset, device)
    teacher = build_teacher(verifier, model, keep_full_lm_head=tc.in_vocab_targets_only)
    objective = Objective(tc.depth_weights, tc.tv_weight, tc.in_vocab_targets_only)
    precision = resolve_precision(tc.precision, device)
    hooks.event(
        "precision", f"training in {precision} (training.precision: {tc.precision})", precision=precision
    )
    train_module = sharding.wrap(model, tc.sharding, info, device, precision=precision)
    optimizer = build_optimizer(model, tc.lr, tc.weight_decay, tc.optimizer)  # after sharding: FSDP's shards
    total_steps = count_steps(spec, train_idx, list(dataset.lengths))
    scheduler = build_scheduler(
        optimizer,
        warmup_steps=math.ceil(tc.warmup_ratio * total_steps),
        total_steps=total_steps,
        min_lr_ratio=tc.min_lr_ratio,
    )
    ckpt_root = out_dir / "checkpoints"
    restored = None
    if resume:
        restored = restore_latest(
            ckpt_root, module=train_module, optimizer=optimizer, scheduler=scheduler, info=info
        )
        if restored is not None:
            hooks.event(
                "resume",
                f"resumed from {restored.path.name} (written by {restored.world_size} ranks, now "
                f"{info.world_size})",
                step=restored.position.step,
                from_world_size=restored.world_size,
                world_size=info.world_size,
            )

    prompts = eval_prompts(spec, dataset, val_idx, verifier)
    categories = eval_categories(spec, dataset, val_idx)
    engines, judge = build_judge(spec, prompts, device, is_main=info.is_main, categories=categories)
    run = Trainer(
        spec=spec,
        out_dir=out_dir,
        info=info,
        device=device,
        hooks=hooks,
        dataset=dataset,
        train_idx=train_idx,
        verifier=verifier,
        source=source,
        model=model,
        train_module=train_module,
        teacher=teacher,
        objective=objective,
        optimizer=optimizer,
        scheduler=scheduler,
        autocast=torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else None,
        precision=precision,
        total_steps=total_steps,
        prompts=prompts,
        ckpt_root=ckpt_root,
        engines=engines,
        judge=judge,
        prompt_categories=categories,
    )
    return run, Progress.resumed(restored)


# ------------------------------------------------------------------------------------------- one step


def forward_backward(
    model: torch.nn.Module,
    teacher: Teacher,
    batch: Any,
    *,
    num_segments: int,
    generator: torch.Generator,
    scale: float,
    autocast: torch.autocast | None = None,
    objective: Objective | None = None,
) -> dict[str, torch.Tensor]:
    """Loss + backward for one packed batch (in `num_segments` sequence partitions when > 1), scored by
    `objective` (default `Objective()`).

    Gradients accumulate in `.grad` scaled by `scale`; returns the batch's metrics as tensors (no host sync).
    """
    with autocast if autocast is not None else contextlib.nullcontext():
        return partitioned_backward(
            model, teacher, batch, num_segments, generator=generator, scale=scale, objective=objective
        )


def cod_generator(seed: int, epoch: int, bin_index: int) -> torch.Generator:
    """COD sampling's random stream for one packed row: a function of the row's place in the run, so the
    same row draws the same anchors at any world size and after any resume."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + epoch) * 1_000_003 + bin_index) % 2**63)


def train_step(run: Trainer, batches: Iterator[Any], shard: StepShard, *, epoch: int) -> dict[str, Any]:
    """One optimizer step: this rank's rows of it (`shard`, the next batches of `batches`), gradients
    accumulated and then reduced over ranks.

    The gradient is the mean over the step's real rows on all ranks: each row's loss is scaled by
    1/`shard.step_bins`, times the world size because DDP and FSDP average the ranks' gradients where a
    sum is wanted; pad rows have weight 0. Returns the step's metrics, means over its real rows: loss,
    acc_{d}, positions_{d}, grad_norm (with clipping), lr (the rate this step used) and tokens_per_s.
    """
    tc, info = run.spec.training, run.info
    started = time.monotonic()
    sums: dict[str, torch.Tensor] = {}
    n = len(shard.bins)
    for i, (row, real) in enumerate(zip(shard.bins, shard.real, strict=True)):
        batch, weight = next(batches), 1.0 if real else 0.0
        with sharding.grad_sync(run.train_module, sync=i == n - 1):  # reduce once, after the last row
            metrics = forward_backward(
                run.train_module,
                run.teacher,
                batch.to(run.device),
                num_segments=tc.num_segments,
                generator=cod_generator(tc.seed, epoch, row),
                scale=weight * info.world_size / shard.step_bins,
                autocast=run.autocast,
                objective=run.objective,
            )
        metrics["tokens"] = torch.tensor(float(batch.num_tokens))
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0) + v.to(run.device) * weight

    norm = None
    if tc.grad_clip is not None:
        norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), tc.grad_clip)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    metrics = _step_metrics(sums, shard.step_bins, norm, info)
    tokens = metrics.pop("tokens")
    # A NaN/infinite loss or gradient would poison the weights and the optimizer's moments for good:
    # such a step updates nothing (the schedule still advances); `check_divergence` ends a streak of them.
    if _finite(metrics):
        run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    lr = run.scheduler.get_last_lr()[0]
    run.scheduler.step()

    elapsed = time.monotonic() - started
    return {**metrics, "lr": lr, "tokens_per_s": tokens / max(elapsed, 1e-9)}


# -------------------------------------------------------------------------------- evaluation and checkpoints


def maybe_evaluate(run: Trainer, progress: Progress) -> EvaluationReport | None:
    """Evaluate every `eval_every_steps` and at the last step; returns this step's report (else None)."""
    every = run.spec.training.eval_every_steps
    due = (every is not None and progress.step % every == 0) or progress.step >= run.total_steps
    if not due:
        return None
    result = evaluate_drafter(run, progress.step, final=progress.step >= run.total_steps)
    if result is not None:
        progress.evaluation = result
    return result


def evaluate_drafter(run: Trainer, step: int, *, final: bool = True) -> EvaluationReport | None:
    """Acceptance length at every evaluated K on the held-out prompts (rank 0; None elsewhere, or
    without prompts): ours, vLLM's spec-decode counters, or both (`evaluation.engine`), with a warning when
    the two disagree. Only the final evaluation is the `eval` stage; one mid-training is an `evaluation`
    event within `train`."""
    if not run.prompts:
        return None
    model = sharding.full_model(run.model, run.info)  # a collective under FSDP
    if model is None or not run.info.is_main:
        return None
    ks = run.spec.speculative_tokens
    engines = [name for name, on in (("peagle", run.engines.ours), ("vllm", run.engines.vllm)) if on]
    run.hooks.event(
        "eval" if final else "evaluation",
        f"evaluating at step {step}",
        prompts=len(run.prompts),
        engines=engines,
    )
    report = EvaluationReport(step=step, results={k: KResult(k) for k in ks})
    if run.engines.ours:
        for k in ks:
            r, categories = evaluate_ours(run, model, k)
            ours = {key: v for key, v in r.to_dict().items() if key != "k"}
            report.results[k].ours = AcceptanceFigures.from_dict(
                ours | {"categories": categories} if categories else ours
            )
            run.hooks.report(
                {"step": step, f"eval/acceptance_length@{k}": r.acceptance_length}
                | per_position_metrics("eval/acceptance_rate", k, r.acceptance_rate_per_position)
            )
    if run.engines.vllm and run.judge is not None:
        figures = run.judge.evaluate_model(model, ks, verifier_config=run.verifier.config)
        for k, fig in figures.items():
            report.results[k].vllm = AcceptanceFigures.from_dict(fig)
        report_vllm_figures(run, step, report)
    return report


def evaluate_ours(
    run: Trainer, model: PEagleDraftModel, k: int
) -> tuple[EvalResult, dict[str, dict[str, Any]]]:
    """Our evaluator at K with the whole drafter `model` on the evaluation prompts, and its figures per
    category where prompts have one (each category decoded apart, then pooled: the pooled figures are the
    ungrouped ones)."""
    eos = run.verifier.tokenizer.eos_token_id
    n = run.spec.evaluation.max_new_tokens
    groups = category_groups(run.prompt_categories)
    if not groups:
        return evaluate(model, run.verifier, run.prompts, k, n, eos), {}
    parts = {
        name: evaluate(model, run.verifier, [run.prompts[i] for i in ix], k, n, eos)
        for name, ix in groups.items()
    }
    return pool_eval(parts, groups), eval_categories_figures(parts)


def per_position_metrics(prefix: str, k: int, rates: list[float]) -> dict[str, float]:
    """`{prefix}@K_pos1`, ...: the share of drafts accepted up to each position, as metric-row scalars."""
    return {f"{prefix}@{k}_pos{j + 1}": rate for j, rate in enumerate(rates)}


def report_vllm_figures(run: Trainer, step: int, report: EvaluationReport) -> None:
    """Report vLLM's acceptance length per K, and warn when it and ours differ by more than 3%."""
    for k, r in report.results.items():
        theirs = r.vllm.acceptance_length if r.vllm is not None else None
        if r.vllm is None or theirs is None:
            continue
        run.hooks.report(
            {"step": step, f"eval/vllm_acceptance_length@{k}": theirs}
            | per_position_metrics("eval/vllm_acceptance_rate", k, r.vllm.rates)
        )
        ours = r.ours.acceptance_length if r.ours is not None else None
        if ours is not None and agreement_gap(ours, theirs) > GAP_TOLERANCE:
            run.hooks.event(
                "eval_gap",
                f"acceptance length at K={k} is {ours:.3f} here but {theirs:.3f} in vLLM "
                f"(gap over {GAP_TOLERANCE:.0%}; both run the same greedy chain)",
                level="warning",
                k=k,
                ours=ours,
                vllm=theirs,
            )


def _finite(metrics: dict[str, Any]) -> bool:
    return all(math.isfinite(metrics[k]) for k in ("loss", "grad_norm") if k in metrics)


def check_divergence(run: Trainer, progress: Progress) -> None:
    """Fail with `diverged` after `training.max_nonfinite_steps` non-finite steps in a row (every rank sees
    the same averaged loss, so all ranks raise together)."""
    limit = run.spec.training.max_nonfinite_steps
    if progress.nonfinite_steps < limit:
        return
    first = progress.step - progress.nonfinite_steps + 1
    kept = progress.checkpoint.name if progress.checkpoint is not None else "none yet"
    raise TrainingDiverged(
        f"the loss was NaN or infinite for {progress.nonfinite_steps} steps in a row (steps {first}-"
        f"{progress.step}); those steps changed no weights and the last good training checkpoint "
        f"({kept}) is kept. Lower training.lr, set training.grad_clip, or check the data and verifier",
        param="training.max_nonfinite_steps",
    )


def maybe_checkpoint(
    run: Trainer, progress: Progress, evaluation: EvaluationReport | None, *, epoch_len: int
) -> None:
    """Save a training checkpoint every `checkpoint_every_steps`, at the last step and when stopping.

    The data position counts the epoch's packed rows consumed (0 of the next epoch when this one is
    done); with COD's randomness a function of that position, it is all a resume at any world size needs
    to continue the same trajectory. Nothing is saved during a streak of non-finite steps, so the newest
    checkpoint is always a good one.
    """
    step = progress.step
    if progress.nonfinite_steps:
        return
    if not (
        progress.stopped or step >= run.total_steps or step % run.spec.training.checkpoint_every_steps == 0
    ):
        return
    at_end = progress.bins_done >= epoch_len
    position = DataPosition(
        step=step,
        epoch=progress.epoch + 1 if at_end else progress.epoch,
        bins_done=0 if at_end else progress.bins_done,
    )
    progress.checkpoint = save_checkpoint(
        run.ckpt_root,
        module=run.train_module,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        position=position,
        info=run.info,
        metrics=progress.metrics,
        extra_json={"eval.json": evaluation.to_dict()} if evaluation is not None else None,
    )


def end_epoch(
    run: Trainer, progress: Progress, *, epoch_len: int, counters: dict[str, int]
) -> dict[str, int]:
    """Report the epoch's hidden-state counters (summed over ranks) and move to the next epoch when this
    one is complete. `counters` are the source's at the epoch's start; returns the current ones."""
    now = run.source.counters()
    stats = dist_utils.sum_across_ranks(_delta(now, counters), run.info, run.device)
    complete = progress.bins_done >= epoch_len
    run.hooks.event(
        "epoch",
        f"epoch {progress.epoch} done: {stats['verifier_calls']} verifier calls, {stats['cache_hits']} cache hits",
        epoch=progress.epoch,
        complete=complete,
        step=progress.step,
        **stats,
    )
    if complete:
        progress.epoch, progress.bins_done = progress.epoch + 1, 0
    return now


def _unverified(_checkpoint_dir: Path, reason: str) -> ServingCheck:
    """The publish gate when vLLM does not judge this export (`reason` says why)."""
    return ServingCheck.unverified(reason)


def export_drafter(
    run: Trainer, progress: Progress, whole: PEagleDraftModel | None
) -> tuple[Path | None, EvaluationReport | None, ServingCheck | None]:
    """Rank 0 writes the validated export of `whole` (the drafter gathered by `sharding.full_model`) to
    out_dir/export/step_N with eval.json beside it; returns the export directory, its evaluation and the
    serving verdict (None, None, None on other ranks)."""
    if progress.evaluation is None:  # resumed from the final checkpoint: its evaluation is not in memory
        progress.evaluation = evaluate_drafter(run, progress.step)
    export_dir = evaluation = check = None
    if run.info.is_main and whole is not None:
        run.hooks.event("export", "exporting the drafter", step=progress.step)
        export_dir = run.out_dir / "export" / f"step_{progress.step}"
        summary = {**_eval_summary(progress.evaluation), "train/loss": progress.metrics.get("loss")}
        k = max(run.spec.speculative_tokens)
        export_checkpoint(
            whole,
            export_dir,
            verifier_name_or_path=run.spec.verifier.name_or_path,
            verifier_config=run.verifier.config,
            data_fingerprint=run.dataset.fingerprint,
            metrics={k: v for k, v in summary.items() if v is not None},
            speculative_tokens=k,
            dtype=run.spec.export.dtype,
            serving=publish_gate(run, progress, k),
        )
        check = ServingCheck.load(export_dir)  # the verdict the export was published under
        assert check is not None  # export_checkpoint saves one with every export
        announce_verdict(run, progress.step, check, k)
        evaluation = (progress.evaluation or EvaluationReport()).with_serving(check.to_dict())
        progress.evaluation = evaluation  # the final metrics read the speed-up from it
        atomic_write_json(export_dir / "eval.json", evaluation.to_dict())
    dist_utils.barrier(run.info)
    return export_dir, evaluation, check


def publish_gate(run: Trainer, progress: Progress, k: int) -> Callable[[Path], ServingCheck]:
    """The check an export at K must pass to be published: vLLM's (lossless, acceptance not collapsed
    against ours at K, speed-ups when asked) where it runs, else an `unverified` verdict saying why."""
    if not (run.engines.gate and run.judge is not None):
        return partial(_unverified, reason=run.engines.gate_off_reason or "no serving check was run")
    run.hooks.event("serving", f"checking the checkpoint in vLLM (K={k})", step=progress.step)
    ours = progress.evaluation.ours(k) if progress.evaluation is not None else None
    return partial(
        run.judge.gate,
        k=k,
        # The collapse check: vLLM's acceptance against ours at K on the same prompts.
        ours=Acceptance.of_figures(ours) if ours is not None else None,
        measure_speedup=run.spec.evaluation.measure_speedup,
        speedup_ks=run.spec.speculative_tokens,
        speedup_batch_sizes=run.spec.evaluation.speedup_batch_sizes,
        speedup_rounds=run.spec.evaluation.speedup_rounds,
        # Each timed round as an event with its count: clients show the timing's progress (`peagle jobs logs -f`).
        on_step=lambda label, done, total: run.hooks.event("serving", label, done=done, total=total),
    )


def announce_verdict(run: Trainer, step: int, check: ServingCheck, k: int) -> None:
    """A verified export's figures as events and metrics: vLLM's acceptance, speed-up, recommendation."""
    if check.status != "verified":
        return
    run.hooks.event(
        "serving",
        f"vLLM served the checkpoint: acceptance length {check.acceptance_length:.3f} at K={k}",
        serving=check.to_dict(),
    )
    if check.speedup and check.speedup.get("speedup") is not None:
        run.hooks.report({"step": step, f"eval/vllm_speedup@{k}": check.speedup["speedup"]})
    if (recommendation := ServingRecommendation.of(check.to_dict())) is not None:
        run.hooks.event("serving", recommendation.sentence(), recommendation=check.recommendation)


def _step_metrics(
    sums: dict[str, torch.Tensor], rows: int, grad_norm: torch.Tensor | None, info: dist_utils.DistInfo
) -> dict[str, Any]:
    """The step's metrics: the per-rank sums over real rows added up over ranks and divided by the step's
    `rows` (`tokens` stays a total), with the gradient norm; pulled to the host once."""
    keys = sorted(sums)
    packed = dist_utils.sum_tensor_across_ranks(torch.stack([sums[k].float() for k in keys]), info)
    if grad_norm is not None:  # the same on every rank: it joins after the sum
        keys.append("grad_norm")
        packed = torch.cat([packed, grad_norm.float().reshape(1).to(packed.device)])
    values = dict(zip(keys, packed.tolist(), strict=True))  # the step's single host sync
    out = {k: (round(v / rows) if k.startswith("positions_") else v / rows) for k, v in values.items()}
    out.update({k: values[k] for k in ("tokens", "grad_norm") if k in values})
    return out


def _eval_summary(report: EvaluationReport | None) -> dict[str, float]:
    if report is None:
        return {}
    out = {}
    for k, r in report.results.items():
        if r.ours is not None and r.ours.acceptance_length is not None:
            out[f"eval/acceptance_length@{k}"] = r.ours.acceptance_length
        if r.vllm is not None:
            out[f"eval/vllm_acceptance_length@{k}"] = r.vllm.acceptance_length
    serving = report.serving
    speedup = serving.speedup.speedup if serving is not None and serving.speedup is not None else None
    if speedup is not None:
        out[f"eval/vllm_speedup@{serving.k}"] = speedup
    return out


def _delta(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: now[k] - before[k] for k in now}
