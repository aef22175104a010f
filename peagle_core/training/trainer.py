"""The Trainer, a training run's parts: what a step updates and the components that own data, evaluation,
checkpoints and publishing; `setup` builds each once from the spec."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from peagle_core.model.drafter import PEagleDraftModel
from peagle_core.model.objective import Objective, Teacher
from peagle_core.spec import JobSpec
from peagle_core.training import distributed as dist_utils
from peagle_core.training.builders import build_model, build_optimizer, build_teacher, load_verifier
from peagle_core.training.checkpointer import Checkpointer
from peagle_core.training.cpu_runtime import keep_freed_memory
from peagle_core.training.evaluator import Evaluator
from peagle_core.training.hooks import Hooks
from peagle_core.training.parallel import ParallelModel
from peagle_core.training.progress import Progress
from peagle_core.training.publisher import Publisher
from peagle_core.training.schedule import scheduler_for
from peagle_core.training.training_data import TrainingData, open_source, open_split


@dataclass
class Trainer:
    """What `setup` builds and the loop reads: the model parts a step updates, and the components that own
    the rest of a run (data, evaluation, checkpoints, export)."""

    spec: JobSpec
    device: torch.device
    hooks: Hooks
    data: TrainingData
    parallel: ParallelModel  # the drafter wrapped for this world size and precision
    teacher: Teacher
    objective: Objective  # how rows score: `training.depth_weights`, `tv_weight`, `in_vocab_targets_only`
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    total_steps: int
    checkpointer: Checkpointer
    evaluator: Evaluator
    publisher: Publisher

    # `train_step` (and the benchmarks that time it) read these on the trainer itself.
    @property
    def info(self) -> dist_utils.DistInfo:
        return self.hooks.info

    @property
    def model(self) -> PEagleDraftModel:
        return self.parallel.model

    @property
    def train_module(self) -> torch.nn.Module:
        return self.parallel.train_module

    @property
    def autocast(self) -> Any:
        return self.parallel.autocast

    def close(self) -> None:
        self.evaluator.close()


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
    """Data, hidden states, drafter, teacher, optimizer and schedule, then the components that evaluate,
    checkpoint and publish; restored from the newest checkpoint under `out_dir` when `resume` finds one."""
    tc = spec.training
    device = dist_utils.device_for(info)
    if device.type == "cpu":
        keep_freed_memory()
    dataset, train_idx, val_idx = open_split(spec, dataset_dir, hooks)
    verifier = load_verifier(spec, device)
    cache_root = Path(cache_dir or spec.hidden_states.cache_uri or out_dir / "cache")
    source = open_source(spec, dataset, verifier, cache_root, hooks)
    data = TrainingData(spec, dataset, train_idx, val_idx, source)

    torch.manual_seed(tc.seed)
    model = build_model(spec, verifier, dataset, device)
    teacher = build_teacher(verifier, model, keep_full_lm_head=tc.in_vocab_targets_only)
    objective = Objective(tc.depth_weights, tc.tv_weight, tc.in_vocab_targets_only)
    total_steps = data.count_steps()
    parallel = ParallelModel.wrap(model, tc, device, hooks, steps=total_steps)
    optimizer = build_optimizer(model, tc.lr, tc.weight_decay, tc.optimizer)  # after wrapping: FSDP's shards
    scheduler = scheduler_for(optimizer, tc, total_steps)
    checkpointer = Checkpointer(
        out_dir / "checkpoints", tc.checkpoint_every_steps, hooks, parallel.train_module, optimizer, scheduler
    )
    restored = checkpointer.restore() if resume else None
    evaluator = Evaluator.build(spec, dataset, val_idx, verifier, device, hooks)
    publisher = Publisher(spec, out_dir / "export", hooks, verifier.config, dataset.fingerprint, evaluator)
    trainer = Trainer(
        spec=spec,
        device=device,
        hooks=hooks,
        data=data,
        parallel=parallel,
        teacher=teacher,
        objective=objective,
        optimizer=optimizer,
        scheduler=scheduler,
        total_steps=total_steps,
        checkpointer=checkpointer,
        evaluator=evaluator,
        publisher=publisher,
    )
    return trainer, Progress.resumed(restored)
