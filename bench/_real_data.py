"""Real training batches for the benches: a job's prepared data and verifier hidden-state cache, opened as
the trainer opens them and read in the trainer's order (the recipe's packing, its seeded epochs)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class RealData:
    """One pipeline's prepared dataset, its verifier and its hidden-state source (offline: the cache)."""

    spec: Any  # JobSpec
    dataset: Any  # PreparedDataset
    verifier: Any  # Verifier
    source: Any  # HiddenStateSource

    @classmethod
    def of(cls, pipeline: Any, device: torch.device | None = None) -> RealData:
        """The data and cache `pipeline` made (run it first: its hidden-states stage builds the cache)."""
        from peagle_core.data.prepare import PreparedDataset
        from peagle_core.training import builders
        from peagle_core.training import distributed as dist_utils

        device = device or torch.device("cpu")
        spec = pipeline.spec
        dataset = PreparedDataset.open(pipeline.data())
        verifier = builders.load_verifier(spec, device)
        source = builders.build_source(spec, dataset, verifier, pipeline.cache_dir(), dist_utils.DistInfo())
        return cls(spec, dataset, verifier, source)

    def bins(self, steps: int) -> list[list[int]]:
        """The first `steps` packed rows in the trainer's order (its seeded epochs, repeated as needed)."""
        from peagle_core.training.builders import epoch_bins

        train_idx, _ = self.dataset.split(self.spec.dataset.val_fraction, self.spec.training.seed)
        lengths = list(self.dataset.lengths)
        bins: list[list[int]] = []
        epoch = 0
        while len(bins) < steps:
            bins += epoch_bins(train_idx, lengths, self.spec, epoch)
            epoch += 1
        return bins[:steps]

    def batches(self, steps: int) -> Iterator[Any]:
        """The first `steps` training batches (PackedBatch), read from the source as the trainer reads them."""
        from peagle_core.hidden_states.loader import BatchLoader

        total = self.spec.training.total_seq_len
        return iter(BatchLoader(self.dataset, self.source, self.bins(steps), total_seq_len=total))

    def drafter(self, device: torch.device | None = None) -> Any:
        """Our drafter for this data as a job builds it (its initialisation, its draft vocabulary map)."""
        from peagle_core.training.builders import build_model

        torch.manual_seed(self.spec.training.seed)
        return build_model(self.spec, self.verifier, self.dataset, device or torch.device("cpu"))


def prepared_pipeline(raw_spec: dict[str, Any], work: Path, store: Path) -> Any:
    """Run `raw_spec`'s pipeline in `work` over a shared `store` (data and cache made once, then reused) and
    return it; give the spec a small `training.max_steps` when only its data and cache are wanted."""
    from peagle_core.pipeline.stages import LocalStore, Pipeline
    from peagle_core.spec import parse_spec

    pipeline = Pipeline.of(parse_spec(raw_spec), work, store=LocalStore(store))
    pipeline.run(resume=True)
    return pipeline
