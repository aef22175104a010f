"""The P-EAGLE training loop: data → hidden states → drafter → optimizer steps, with evaluation, checkpoints
and the export.

`train()` reads like nanoGPT's loop: `setup` builds the `Trainer` once (its data, drafter, teacher,
optimizer and the components that evaluate, checkpoint and publish), then each iteration runs `train_step`
and hands the step to the evaluator and the checkpointer, and the end publishes the drafter. Under torchrun
it trains data-parallel (DDP or FSDP2, `training.sharding`); a step's rows, gradient and randomness do not
depend on how many ranks run it, so a checkpoint resumes at any world size.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from peagle_core.data.packing import StepShard, step_shards
from peagle_core.errors import TrainingDiverged
from peagle_core.events import CallbackReporter, Reporter
from peagle_core.model.objective import Objective, Teacher
from peagle_core.model.partition import partitioned_backward
from peagle_core.spec import JobSpec
from peagle_core.training import distributed as dist_utils
from peagle_core.training import sharding
from peagle_core.training.builders import global_batch_bins
from peagle_core.training.cpu_runtime import trim_freed_memory
from peagle_core.training.evaluator import eval_summary
from peagle_core.training.hooks import ConsumedFn, Hooks
from peagle_core.training.progress import Progress
from peagle_core.training.result import PipelineResult
from peagle_core.training.trainer import Trainer, setup

__all__ = ["Hooks", "Progress", "Trainer", "forward_backward", "setup", "train", "train_step"]


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
        if run is not None:
            run.close()  # the vLLM judge's engine
        run = None  # the DDP/FSDP wrappers go before the process group (`dist_utils.shutdown`)
        dist_utils.shutdown()


def _train(run: Trainer, progress: Progress) -> PipelineResult:
    """The loop: optimizer steps with evaluation and checkpoints until done or stopped, then the export."""
    spec, tc, hooks = run.spec, run.spec.training, run.hooks
    hooks.event("train", "training", total_steps=run.total_steps, world_size=run.info.world_size)
    run.model.train()
    counters = run_start = run.data.source.counters()
    started, first_step = time.monotonic(), progress.step
    rows_per_step, info = global_batch_bins(spec), run.info
    while progress.running(run.total_steps) and progress.epoch < tc.epochs:
        bins = run.data.epoch_bins(progress.epoch)
        shards = step_shards(len(bins), progress.bins_done, rows_per_step, info.rank, info.world_size)
        rows = [bins[b] for shard in shards for b in shard.bins]
        with contextlib.closing(iter(run.data.loader(rows))) as batches:
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
                evaluation = run.evaluator.maybe_evaluate(run.model, progress.step, run.total_steps)
                progress.evaluation = evaluation or progress.evaluation
                run.checkpointer.maybe_save(
                    progress, evaluation, epoch_len=len(bins), total_steps=run.total_steps
                )
        # Closing the loader joined its thread, so the source's counters are final for this epoch.
        if not progress.stopped:
            counters = end_epoch(run, progress, epoch_len=len(bins), counters=counters)
    return finish(run, progress, run_start)


def finish(run: Trainer, progress: Progress, run_start: dict[str, int]) -> PipelineResult:
    """The run's result: where it stopped, or the published export with its evaluation and verdict; with
    the hidden-state source's counters since `run_start`, summed over ranks."""
    run.data.source.close()  # a hybrid run that ended mid-epoch still keeps what it computed
    totals = dist_utils.sum_across_ranks(_delta(run.data.source.counters(), run_start), run.info, run.device)
    whole = sharding.full_model(run.model, run.info)  # a collective under FSDP
    result = PipelineResult(
        "stopped", progress.step, progress.checkpoint, model=whole if whole is not None else run.model
    )
    if progress.stopped:
        run.hooks.event("stopped", f"stopped at step {progress.step}", step=progress.step)
        result.metrics = {**progress.metrics, **totals}
        return result
    if progress.evaluation is None:  # resumed from the final checkpoint: its evaluation is not in memory
        progress.evaluation = run.evaluator.evaluate(run.model, progress.step)
    result.status = "completed"
    result.export_dir, result.evaluation, result.serving = run.publisher.publish(
        whole, progress.step, progress.evaluation, loss=progress.metrics.get("loss")
    )
    progress.evaluation = result.evaluation or progress.evaluation  # the final metrics read the speed-up
    result.metrics = {**progress.metrics, **eval_summary(progress.evaluation), **totals}
    return result


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
                run.parallel.step_module,
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


# ------------------------------------------------------------------------------------------- bookkeeping


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


def end_epoch(
    run: Trainer, progress: Progress, *, epoch_len: int, counters: dict[str, int]
) -> dict[str, int]:
    """Report the epoch's hidden-state counters (summed over ranks) and move to the next epoch when this
    one is complete. `counters` are the source's at the epoch's start; returns the current ones."""
    now = run.data.source.counters()
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


def _delta(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: now[k] - before[k] for k in now}
