"""What a run trains on: the prepared dataset's split, its hidden-state source and each epoch's packed rows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from peagle_core.data import PreparedDataset
from peagle_core.errors import DataError
from peagle_core.events import LOG
from peagle_core.hidden_states.loader import BatchLoader, HiddenStateSource
from peagle_core.hidden_states.verifier import Verifier
from peagle_core.keys import HIDDEN_STATES
from peagle_core.spec import JobSpec
from peagle_core.training.builders import build_source, count_steps, epoch_bins
from peagle_core.training.hooks import Hooks


@dataclass
class TrainingData:
    """The training split of `dataset` (`val_idx` is held out for evaluation) read through `source`."""

    spec: JobSpec
    dataset: PreparedDataset
    train_idx: list[int]
    val_idx: list[int]
    source: HiddenStateSource

    def epoch_bins(self, epoch: int) -> list[list[int]]:
        """The packed rows of `epoch` as lists of dataset indices, in the one order every world size shares."""
        return epoch_bins(self.train_idx, list(self.dataset.lengths), self.spec, epoch)

    def count_steps(self) -> int:
        return count_steps(self.spec, self.train_idx, list(self.dataset.lengths))

    def loader(self, rows: list[list[int]]) -> BatchLoader:
        """The packed batches of `rows`, hidden states included."""
        return BatchLoader(self.dataset, self.source, rows, total_seq_len=self.spec.training.total_seq_len)


def open_split(
    spec: JobSpec, dataset_dir: str | Path, hooks: Hooks
) -> tuple[PreparedDataset, list[int], list[int]]:
    """The prepared dataset at `dataset_dir` (the pipeline's prepare stage made it), split into training and
    validation samples; DataError when no training sample is left."""
    dataset = PreparedDataset.open(dataset_dir)
    train_idx, val_idx = dataset.split(spec.dataset.val_fraction, spec.training.seed)
    if not train_idx:
        raise DataError("no training samples left after the validation split", param="dataset.val_fraction")
    hooks.event("data", "dataset ready", samples=len(dataset), train=len(train_idx), val=len(val_idx))
    return dataset, train_idx, val_idx


def open_source(
    spec: JobSpec, dataset: PreparedDataset, verifier: Verifier, cache_root: Path, hooks: Hooks
) -> HiddenStateSource:
    """The hidden-state source of `spec.hidden_states.mode`, announced (an offline cache is built first)."""
    hooks.event("hidden_states", f"hidden states: {spec.hidden_states.mode}", cache_dir=str(cache_root))
    return build_source(
        spec, dataset, verifier, cache_root, hooks.info, should_stop=hooks.should_stop,
        on_progress=build_progress(hooks),
    )  # fmt: skip


BUILD_PROGRESS_EVENTS = 20  # about this many progress events per cache build, at most


def build_progress(hooks: Hooks) -> Callable[[int, int], None]:
    """A cache build's progress as counted log events (the job's progress bar shows their count and ETA):
    the start, then after every 1/BUILD_PROGRESS_EVENTS of its tokens, and the end."""
    last: int | None = None

    def progress(done: int, total: int) -> None:
        nonlocal last
        if last is not None and done < total and done - last < total / BUILD_PROGRESS_EVENTS:
            return
        last = done
        hooks.event(LOG, "building the hidden-state cache", kind=HIDDEN_STATES, done=done, total=total,
                    unit="tokens")  # fmt: skip

    return progress
