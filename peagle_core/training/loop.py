"""The P-EAGLE training loop: data → hidden states → drafter → AdamW steps with checkpoints, eval and export.

`train()` reads like torchtitan's trainer in miniature: `setup` builds everything once (data, hidden-state
source, drafter, teacher, optimizer, resume point), then each loop iteration calls `train_step`,
`maybe_evaluate` and `maybe_checkpoint`, and the end exports the drafter. Under torchrun it trains
data-parallel.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from peagle_core.data import PreparedDataset
from peagle_core.errors import DataError, TrainingDiverged
from peagle_core.evaluation.acceptance import EvalResult, evaluate
from peagle_core.hidden_states.loader import BatchLoader, HiddenStateSource
from peagle_core.hidden_states.verifier import Verifier
from peagle_core.io import atomic_write_json
from peagle_core.model.drafter import PEagleDraftModel
from peagle_core.model.objective import Teacher
from peagle_core.model.partition import partitioned_backward
from peagle_core.serving.categories import category_groups, eval_categories_figures, pool_eval
from peagle_core.serving.export import export_checkpoint
from peagle_core.serving.gate import Acceptance, ServingCheck
from peagle_core.serving.judge import (
    GAP_TOLERANCE,
    Engines,
    VllmJudge,
    agreement_gap,
)
from peagle_core.spec import JobSpec
from peagle_core.training import distributed as dist_utils
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
    load_verifier,
)
from peagle_core.training.result import PipelineResult
from peagle_core.training.resume import (
    DataPosition,
    TrainingState,
    capture_rng,
    restore_latest,
    save_checkpoint,
    step_dir_name,
)
from peagle_core.training.schedule import build_scheduler

MetricsFn = Callable[[dict[str, Any]], None]
EventFn = Callable[[str, str, dict[str, Any]], None]


@dataclass
class Hooks:
    """The caller's callbacks: only rank 0 reports metrics and events; a stop request stops every rank."""

    info: dist_utils.DistInfo
    on_metrics: MetricsFn | None = None
    on_event: EventFn | None = None
    should_stop: Callable[[], bool] | None = None

    def event(self, kind: str, message: str, **data: Any) -> None:
        if self.on_event is not None and self.info.is_main:
            self.on_event(kind, message, data)

    def report(self, metrics: dict[str, Any]) -> None:
        if self.on_metrics is not None and self.info.is_main:
            self.on_metrics(metrics)

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
    model: PEagleDraftModel
    ddp_model: torch.nn.Module  # the drafter, wrapped in DDP under torchrun
    teacher: Teacher
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    cod_generator: torch.Generator
    autocast: Any  # bf16 autocast on CUDA, None on CPU (fp32)
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
    batch_index: int = 0  # the epoch's next micro-batch
    metrics: dict[str, Any] = field(default_factory=dict)  # the last step's
    checkpoint: Path | None = None  # the newest training checkpoint
    evaluation: dict[str, Any] | None = None  # the last evaluation's results
    stopped: bool = False
    nonfinite_steps: int = 0  # consecutive steps whose loss or gradient norm was NaN/infinite

    @classmethod
    def resumed(cls, state: TrainingState | None) -> Progress:
        """Progress at a restored checkpoint's data position (the start when there is none)."""
        if state is None:
            return cls()
        at = state.position
        return cls(step=at.step, epoch=at.epoch, batch_index=at.batch_index, checkpoint=state.path)

    def running(self, total_steps: int) -> bool:
        return not self.stopped and self.step < total_steps

    def advance(self, n_micro: int) -> None:
        """One optimizer step over `n_micro` micro-batches is done."""
        self.step += 1
        self.batch_index += n_micro


# ------------------------------------------------------------------------------------------------ train


def train(
    spec: JobSpec,
    out_dir: str | Path,
    *,
    on_metrics: MetricsFn | None = None,
    should_stop: Callable[[], bool] | None = None,
    resume: bool = True,
    dataset_dir: str | Path,
    cache_dir: str | Path | None = None,
    on_event: EventFn | None = None,
) -> PipelineResult:
    """The training stage: train a drafter as `spec` says on the prepared dataset at `dataset_dir`, writing
    checkpoints and the final export under `out_dir`. `peagle_core.pipeline.stages.run_pipeline` runs the whole job
    (regeneration and data preparation first)."""
    info = dist_utils.init_distributed()
    hooks = Hooks(info, on_metrics=on_metrics, on_event=on_event, should_stop=should_stop)
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
        dist_utils.shutdown()


def _train(run: Trainer, progress: Progress) -> PipelineResult:
    """The loop: optimizer steps with evaluation and checkpoints until done or stopped, then the export."""
    spec, tc, hooks = run.spec, run.spec.training, run.hooks
    hooks.event("train", "training", total_steps=run.total_steps, world_size=run.info.world_size)
    run.model.train()
    counters = run_start = run.source.counters()
    started, first_step = time.monotonic(), progress.step
    while progress.running(run.total_steps) and progress.epoch < tc.epochs:
        bins = epoch_bins(run.train_idx, list(run.dataset.lengths), spec, progress.epoch, run.info)
        loader = BatchLoader(
            run.dataset, run.source, bins, total_seq_len=tc.total_seq_len, start=progress.batch_index
        )
        with contextlib.closing(iter(loader)) as batches:
            while progress.running(run.total_steps) and progress.batch_index < len(bins):
                n_micro = min(tc.grad_accum, len(bins) - progress.batch_index)
                metrics = train_step(run, batches, n_micro)
                progress.advance(n_micro)
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

    result = PipelineResult("stopped", progress.step, progress.checkpoint, model=run.model)
    if progress.stopped:
        hooks.event("stopped", f"stopped at step {progress.step}", step=progress.step)
        result.metrics = {**progress.metrics, **totals}
    else:
        result.status = "completed"
        result.export_dir, result.evaluation, result.serving = export_drafter(run, progress)
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
    teacher = build_teacher(verifier, model)
    optimizer = build_optimizer(model, tc.lr, tc.weight_decay)
    total_steps = count_steps(spec, train_idx, list(dataset.lengths), info)
    scheduler = build_scheduler(
        optimizer,
        warmup_steps=math.ceil(tc.warmup_ratio * total_steps),
        total_steps=total_steps,
        min_lr_ratio=tc.min_lr_ratio,
    )
    cod_generator = torch.Generator().manual_seed(tc.seed * 1_000_003 + info.rank)
    ckpt_root = out_dir / "checkpoints"
    restored = None
    if resume:
        restored = restore_latest(
            ckpt_root,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            cod_generator=cod_generator,
            rank=info.rank,
            world_size=info.world_size,
        )
        if restored is not None:
            hooks.event("resume", f"resumed from {restored.path.name}", step=restored.position.step)

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
        ddp_model=DistributedDataParallel(model) if info.enabled else model,
        teacher=teacher,
        optimizer=optimizer,
        scheduler=scheduler,
        cod_generator=cod_generator,
        autocast=torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None,
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
) -> dict[str, torch.Tensor]:
    """Loss + backward for one packed batch (in `num_segments` sequence partitions when > 1).

    Gradients accumulate in `.grad` scaled by `scale`; returns the batch's metrics as tensors (no host sync).
    """
    with autocast if autocast is not None else contextlib.nullcontext():
        return partitioned_backward(model, teacher, batch, num_segments, generator=generator, scale=scale)


def train_step(run: Trainer, batches: Iterator[Any], n_micro: int) -> dict[str, Any]:
    """One optimizer step over the next `n_micro` micro-batches of `batches` (gradient accumulation).

    Returns the step's metrics, averaged over micro-batches and ranks: loss, acc_{d}, positions_{d},
    lr (the rate this step used) and tokens_per_s.
    """
    tc = run.spec.training
    started = time.monotonic()
    sums: dict[str, torch.Tensor] = {}
    tokens = micro = 0
    for micro, batch in enumerate(itertools.islice(batches, n_micro), start=1):
        # Only the last micro-batch of a step all-reduces gradients.
        last = micro == n_micro
        sync = run.ddp_model.no_sync() if run.info.enabled and not last else contextlib.nullcontext()
        with sync:
            metrics = forward_backward(
                run.ddp_model,
                run.teacher,
                batch.to(run.device),
                num_segments=tc.num_segments,
                generator=run.cod_generator,
                scale=1.0 / tc.grad_accum,
                autocast=run.autocast,
            )
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0) + v
        tokens += int(batch.num_tokens)

    if micro < tc.grad_accum:  # a short final accumulation: rescale to a mean over what we saw
        for p in run.model.parameters():
            if p.grad is not None:
                p.grad.mul_(tc.grad_accum / micro)
    if tc.grad_clip is not None:
        norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), tc.grad_clip)
        sums["grad_norm"] = norm * micro  # _step_metrics averages over micro-batches
    metrics = _step_metrics(sums, micro, run.info, run.device)
    # A NaN/infinite loss or gradient would poison the weights and the optimizer's moments for good:
    # such a step updates nothing (the schedule still advances); `check_divergence` ends a streak of them.
    if _finite(metrics):
        run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    lr = run.scheduler.get_last_lr()[0]
    run.scheduler.step()

    elapsed = time.monotonic() - started
    return {**metrics, "lr": lr, "tokens_per_s": tokens * run.info.world_size / max(elapsed, 1e-9)}


# -------------------------------------------------------------------------------- evaluation and checkpoints


def maybe_evaluate(run: Trainer, progress: Progress) -> dict[str, Any] | None:
    """Evaluate every `eval_every_steps` and at the last step; returns this step's results (else None)."""
    every = run.spec.training.eval_every_steps
    due = (every is not None and progress.step % every == 0) or progress.step >= run.total_steps
    if not due:
        return None
    result = evaluate_drafter(run, progress.step, final=progress.step >= run.total_steps)
    if result:
        progress.evaluation = result
    return result


def evaluate_drafter(run: Trainer, step: int, *, final: bool = True) -> dict[str, Any]:
    """Acceptance length at every evaluated K on the held-out prompts (rank 0; {} elsewhere): ours, vLLM's
    spec-decode counters, or both (`evaluation.engine`), with a warning when the two disagree. Only the
    final evaluation is the `eval` stage; one mid-training is an `evaluation` event within `train`."""
    if not run.info.is_main or not run.prompts:
        return {}
    ks = run.spec.speculative_tokens
    engines = [name for name, on in (("peagle", run.engines.ours), ("vllm", run.engines.vllm)) if on]
    run.hooks.event(
        "eval" if final else "evaluation",
        f"evaluating at step {step}",
        prompts=len(run.prompts),
        engines=engines,
    )
    results: dict[str, dict[str, Any]] = {f"k={k}": {"k": k} for k in ks}
    if run.engines.ours:
        for k in ks:
            r, categories = evaluate_ours(run, k)
            results[f"k={k}"].update(r.to_dict())
            if categories:
                results[f"k={k}"]["categories"] = categories
            run.hooks.report(
                {"step": step, f"eval/acceptance_length@{k}": r.acceptance_length}
                | per_position_metrics("eval/acceptance_rate", k, r.acceptance_rate_per_position)
            )
    if run.engines.vllm and run.judge is not None:
        figures = run.judge.evaluate_model(run.model, ks, verifier_config=run.verifier.config)
        for k, fig in figures.items():
            results[f"k={k}"]["vllm"] = fig
        report_vllm_figures(run, step, results)
    return {"step": step, "results": results}


def evaluate_ours(run: Trainer, k: int) -> tuple[EvalResult, dict[str, dict[str, Any]]]:
    """Our evaluator at K on the evaluation prompts, and its figures per category where prompts have one
    (each category decoded apart, then pooled: the pooled figures are the ungrouped ones)."""
    eos = run.verifier.tokenizer.eos_token_id
    n = run.spec.evaluation.max_new_tokens
    groups = category_groups(run.prompt_categories)
    if not groups:
        return evaluate(run.model, run.verifier, run.prompts, k, n, eos), {}
    parts = {
        name: evaluate(run.model, run.verifier, [run.prompts[i] for i in ix], k, n, eos)
        for name, ix in groups.items()
    }
    return pool_eval(parts, groups), eval_categories_figures(parts)


def per_position_metrics(prefix: str, k: int, rates: list[float]) -> dict[str, float]:
    """`{prefix}@K_pos1`, ...: the share of drafts accepted up to each position, as metric-row scalars."""
    return {f"{prefix}@{k}_pos{j + 1}": rate for j, rate in enumerate(rates)}


def report_vllm_figures(run: Trainer, step: int, results: dict[str, dict[str, Any]]) -> None:
    """Report vLLM's acceptance length per K, and warn when it and ours differ by more than 3%."""
    for r in results.values():
        theirs = r.get("vllm", {}).get("acceptance_length")
        if theirs is None:
            continue
        k = r["k"]
        rates = r["vllm"].get("acceptance_rate_per_position") or []
        run.hooks.report(
            {"step": step, f"eval/vllm_acceptance_length@{k}": theirs}
            | per_position_metrics("eval/vllm_acceptance_rate", k, rates)
        )
        ours = r.get("acceptance_length")
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
    run: Trainer, progress: Progress, evaluation: dict[str, Any] | None, *, epoch_len: int
) -> None:
    """Save a training checkpoint every `checkpoint_every_steps`, at the last step and when stopping.

    Every rank's RNG state goes in, so a resumed run continues bit for bit; the data position points at
    the next micro-batch (the next epoch's first when this one is done). Nothing is saved during a streak
    of non-finite steps, so the newest checkpoint is always a good one.
    """
    step = progress.step
    if progress.nonfinite_steps:
        return
    if not (
        progress.stopped or step >= run.total_steps or step % run.spec.training.checkpoint_every_steps == 0
    ):
        return
    at_end = progress.batch_index == epoch_len
    position = DataPosition(
        step=step,
        epoch=progress.epoch + 1 if at_end else progress.epoch,
        batch_index=0 if at_end else progress.batch_index,
    )
    rngs = dist_utils.all_gather_tensors_state(capture_rng(run.cod_generator), run.info)
    if run.info.is_main:
        save_checkpoint(
            run.ckpt_root,
            model=run.model,
            optimizer=run.optimizer,
            scheduler=run.scheduler,
            position=position,
            rng={"ranks": rngs},
            metrics=progress.metrics,
            extra_json={"eval.json": evaluation} if evaluation else None,
        )
    dist_utils.barrier(run.info)
    progress.checkpoint = run.ckpt_root / step_dir_name(step)


def end_epoch(
    run: Trainer, progress: Progress, *, epoch_len: int, counters: dict[str, int]
) -> dict[str, int]:
    """Report the epoch's hidden-state counters (summed over ranks) and move to the next epoch when this
    one is complete. `counters` are the source's at the epoch's start; returns the current ones."""
    now = run.source.counters()
    stats = dist_utils.sum_across_ranks(_delta(now, counters), run.info, run.device)
    complete = progress.batch_index == epoch_len
    run.hooks.event(
        "epoch",
        f"epoch {progress.epoch} done: {stats['verifier_calls']} verifier calls, {stats['cache_hits']} cache hits",
        epoch=progress.epoch,
        complete=complete,
        step=progress.step,
        **stats,
    )
    if complete:
        progress.epoch, progress.batch_index = progress.epoch + 1, 0
    return now


def _unverified(_checkpoint_dir: Path, reason: str) -> ServingCheck:
    """The publish gate when vLLM does not judge this export (`reason` says why)."""
    return ServingCheck.unverified(reason)


def export_drafter(
    run: Trainer, progress: Progress
) -> tuple[Path | None, dict[str, Any] | None, ServingCheck | None]:
    """Rank 0 writes the validated export to out_dir/export/step_N with eval.json beside it; returns the
    export directory, its evaluation and the serving verdict (None, None, None on other ranks)."""
    if progress.evaluation is None:  # resumed from the final checkpoint: its evaluation is not in memory
        progress.evaluation = evaluate_drafter(run, progress.step)
    export_dir = evaluation = check = None
    if run.info.is_main:
        run.hooks.event("export", "exporting the drafter", step=progress.step)
        export_dir = run.out_dir / "export" / f"step_{progress.step}"
        summary = {**_eval_summary(progress.evaluation), "train/loss": progress.metrics.get("loss")}
        k = max(run.spec.speculative_tokens)
        if run.engines.gate and run.judge is not None:
            run.hooks.event("serving", f"checking the checkpoint in vLLM (K={k})", step=progress.step)
            ours = ((progress.evaluation or {}).get("results") or {}).get(f"k={k}") or {}
            gate: Callable[[Path], ServingCheck] = partial(
                run.judge.gate,
                k=k,
                # The collapse check: vLLM's acceptance against ours at K on the same prompts.
                ours=Acceptance.of(ours) if "acceptance_length" in ours else None,
                measure_speedup=run.spec.evaluation.measure_speedup,
            )
        else:
            reason = run.engines.gate_off_reason or "no serving check was run"
            gate = partial(_unverified, reason=reason)
        verdicts: list[ServingCheck] = []

        def serving(checkpoint_dir: Path) -> ServingCheck:
            verdicts.append(gate(checkpoint_dir))
            return verdicts[-1]

        export_checkpoint(
            run.model,
            export_dir,
            verifier_name_or_path=run.spec.verifier.name_or_path,
            verifier_config=run.verifier.config,
            data_fingerprint=run.dataset.fingerprint,
            metrics={k: v for k, v in summary.items() if v is not None},
            speculative_tokens=k,
            dtype=run.spec.export.dtype,
            serving=serving,
        )
        check = verdicts[-1]
        if check.status == "verified":
            run.hooks.event(
                "serving",
                f"vLLM served the checkpoint: acceptance length {check.acceptance_length:.3f} at K={k}",
                serving=check.to_dict(),
            )
            if check.speedup and check.speedup.get("speedup") is not None:
                run.hooks.report({"step": progress.step, f"eval/vllm_speedup@{k}": check.speedup["speedup"]})
        evaluation = {**(progress.evaluation or {}), "serving": check.to_dict()}
        progress.evaluation = evaluation  # the final metrics read the speed-up from it
        atomic_write_json(export_dir / "eval.json", evaluation)
    dist_utils.barrier(run.info)
    return export_dir, evaluation, check


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
    out = {}
    for r in eval_result.get("results", {}).values():
        if "acceptance_length" in r:
            out[f"eval/acceptance_length@{r['k']}"] = r["acceptance_length"]
        if "vllm" in r:
            out[f"eval/vllm_acceptance_length@{r['k']}"] = r["vllm"]["acceptance_length"]
    speedup = ((eval_result.get("serving") or {}).get("speedup") or {}).get("speedup")
    if speedup is not None:
        out[f"eval/vllm_speedup@{eval_result['serving']['k']}"] = speedup
    return out


def _delta(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: now[k] - before[k] for k in now}
