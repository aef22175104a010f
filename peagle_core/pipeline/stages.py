"""The one job pipeline, for `peagle train` and the worker alike: regenerate → prepare → hidden states →
train → eval → export, returning one typed result with the serving verdict.

Reusable stage outputs live in a `Store` under their stage key (`peagle_core.keys`): `LocalStore`
for the CLI, the service's `ArtifactStore` for the worker. The caller supplies the store and callbacks;
the worker adds its fencing (`before_train`) and, for multi-GPU jobs, where training runs (`train_stage`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from peagle_core import keys as stage_keys
from peagle_core.data.formats import DEFAULT_MAX_LINE_BYTES
from peagle_core.data.source import InputFile
from peagle_core.errors import DataError, StopRequested
from peagle_core.events import CallbackReporter, Event, Level, Reporter
from peagle_core.io import atomic_dir
from peagle_core.keys import HIDDEN_STATES, PREPARE, REGENERATE
from peagle_core.spec import JobSpec
from peagle_core.training.result import PipelineResult

if TYPE_CHECKING:
    from peagle_core.regeneration.rewrite import RegenReport

log = logging.getLogger(__name__)

REGENERATED = "data.jsonl"


class Store(Protocol):
    """Where stage outputs are kept, as directories under keys (`prepared/<stage key>`)."""

    def exists(self, key: str) -> bool: ...

    def local_path(self, key: str) -> Path | None:
        """The directory a key lives in when the store is this machine's filesystem, else None."""
        ...

    def fetch_dir(self, key: str, dest: str | os.PathLike[str]) -> Path: ...

    def publish_dir(self, local_dir: str | os.PathLike[str], key: str) -> Any: ...


class LocalStore:
    """A `Store` in a local directory (`peagle train` keeps its stage outputs under its output directory)."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)

    def exists(self, key: str) -> bool:
        return (self.root / key).exists()

    def local_path(self, key: str) -> Path:
        return self.root / key

    def fetch_dir(self, key: str, dest: str | os.PathLike[str]) -> Path:
        shutil.copytree(self.root / key, dest, dirs_exist_ok=True)
        return Path(dest)

    def publish_dir(self, local_dir: str | os.PathLike[str], key: str) -> None:
        with atomic_dir(self.root / key) as tmp:
            shutil.copytree(local_dir, tmp, dirs_exist_ok=True)


@dataclass
class Callbacks:
    """What the caller hears (`reporter`: the run's events and metrics) and how it stops the run."""

    reporter: Reporter = field(default_factory=CallbackReporter)
    on_progress: Callable[[dict[str, Any]], None] | None = None  # a stage's own counters (`regenerate`)
    should_stop: Callable[[], bool] | None = None  # polled every training step
    should_stop_now: Callable[[], bool] | None = None  # before each regeneration batch (default should_stop)
    # A stage output this job uses, made or reused: (kind, store key, local directory or None). The worker
    # charges its bytes to the project (`regenerated`, `prepared`, `cache`).
    on_stored: Callable[[str, str, Path | None], None] | None = None

    def stored(self, kind: str, key: str, local: Path | None) -> None:
        if self.on_stored is not None:
            self.on_stored(kind, key, local)

    def event(self, kind: str, message: str, /, *, level: Level = "info", **data: Any) -> None:
        self.reporter.on_event(Event(kind, message, data, level))

    def log(self, kind: str, message: str, /, *, level: Level = "info", **data: Any) -> None:
        self.reporter.on_event(Event.log(kind, message, level=level, **data))


# (spec, work_dir, dataset_dir, cache_dir, callbacks, resume) -> result: where the training stage runs.
TrainStage = Callable[[JobSpec, Path, Path, Path, Callbacks, bool], PipelineResult]


def run_pipeline(
    spec: JobSpec, work_dir: str | Path, *, callbacks: Callbacks | None = None, resume: bool = True
) -> PipelineResult:
    """`peagle train`: the whole pipeline in `work_dir`, its stage outputs kept there (a `LocalStore`)."""
    return Pipeline.of(spec, Path(work_dir), callbacks=callbacks).run(resume=resume)


def train_here(
    spec: JobSpec, work_dir: Path, dataset_dir: Path, cache_dir: Path, cb: Callbacks, resume: bool
) -> PipelineResult:
    """The training stage in this process (it announces hidden_states, train, eval and export itself)."""
    from peagle_core.training.loop import train

    return train(
        spec,
        work_dir,
        dataset_dir=dataset_dir,
        cache_dir=cache_dir,
        reporter=cb.reporter,
        should_stop=cb.should_stop,
        resume=resume,
    )


@dataclass
class Pipeline:
    """One job's pipeline: the stages before training (regenerate, prepare) each reuse the store's output
    under its stage key; then the training stage runs (hidden states, train, eval, export)."""

    spec: JobSpec
    store: Store
    source: InputFile  # checked and hashed once: every stage reads this identity
    verifier_fp: str
    scratch: Path
    work_dir: Path
    cb: Callbacks
    max_line_bytes: int

    @classmethod
    def of(
        cls,
        spec: JobSpec,
        work_dir: Path,
        *,
        store: Store | None = None,
        source: InputFile | None = None,
        scratch: Path | None = None,
        callbacks: Callbacks | None = None,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    ) -> Pipeline:
        """The pipeline of `spec` in `work_dir` (checkpoints, export), reusing the stage outputs `store`
        holds (default: a `LocalStore` in `work_dir`). `source` is the JSONL to train on (default
        `dataset.path`, checked and hashed here); `scratch` holds a remote store's outputs on this machine.
        Hashes the verifier's files (memoised per process)."""
        if source is None:
            if spec.dataset.path is None:
                raise DataError(
                    "dataset.id needs the service to resolve it to a file; give dataset.path", param="dataset"
                )
            source = InputFile.of(spec.dataset.path, param="dataset.path")
        return cls(
            spec,
            store if store is not None else LocalStore(work_dir),
            source,
            stage_keys.verifier_fingerprint(spec.verifier.name_or_path, spec.verifier.revision),
            scratch or work_dir / "scratch",
            work_dir,
            callbacks or Callbacks(),
            max_line_bytes,
        )

    def run(
        self,
        *,
        resume: bool = True,
        before_train: Callable[[], None] | None = None,
        train_stage: TrainStage | None = None,
    ) -> PipelineResult:
        """Every stage, or up to a stop request. `before_train` runs once the data is ready (the worker
        restores its resume point there); `train_stage` trains elsewhere (torchrun) instead of here."""
        from peagle_core.training import distributed as dist_utils

        # Under torchrun (`peagle train` on several GPUs) rank 0 makes the data and the others read it.
        info = dist_utils.init_distributed()
        dataset_dir = None
        try:
            if info.is_main:
                dataset_dir = self.data()
        finally:
            dist_utils.barrier(info)
        if not info.is_main:
            dataset_dir = self.data_if_ready()
        if dataset_dir is None:
            return PipelineResult.stopped()
        cache_dir = self.cache_dir()
        if before_train is not None:
            before_train()
        train = train_stage or train_here
        try:
            return train(self.spec, self.work_dir, dataset_dir, cache_dir, self.cb, resume)
        except StopRequested as stop:  # a stop before the first step (the hidden-state build)
            self.cb.log("stopped", str(stop))
            return PipelineResult.stopped()

    def _key(self, stage: str) -> str:
        key_fn = {
            REGENERATE: stage_keys.regenerate_key,
            PREPARE: stage_keys.prepare_key,
            HIDDEN_STATES: stage_keys.hidden_states_key,
        }[stage]
        return key_fn(self.spec, self.source.sha256, self.verifier_fp)

    def _location(self, prefix: str, stage: str) -> tuple[str, Path | None]:
        key = f"{prefix}/{self._key(stage)}"
        return key, self.store.local_path(key)

    def data(self) -> Path | None:
        """The prepared dataset directory, or None when a stop request ended regeneration."""
        source = self.source
        if self.spec.dataset.regenerate is not None:
            regenerated = self.regenerate()
            if regenerated is None:
                return None
            source = regenerated
        return self.prepare(source)

    def data_if_ready(self) -> Path | None:
        """Another rank's view: the prepared dataset rank 0 left in a local store, if it finished."""
        _, local = self._location("prepared", PREPARE)
        if local is None:
            raise DataError("a multi-rank run without a worker needs a local store", param="dataset")
        return local if (local / "manifest.json").is_file() else None

    # -- regenerate --------------------------------------------------------------------------------

    def regenerate(self) -> InputFile | None:
        """The regenerated JSONL: reused, resumed or run. None when a stop request ended it."""
        key, work = self._regeneration_dir()
        # Two jobs asking for the same rewrite on one machine: the second waits, then finds it finished.
        with _locked(work):
            reused = self._reuse_regenerated(key, work)
            if reused is not None:
                return reused
            report = self._rewrite(work / REGENERATED)
            if report.status == "stopped":
                return None
        return self._publish_regenerated(key, work, report)

    def _regeneration_dir(self) -> tuple[str, Path]:
        """The regeneration's store key and its directory on this machine: the store's own when local,
        else scratch, fetched from the store when it holds a finished output scratch lacks."""
        from peagle_core.regeneration.rewrite import provenance_path, read_provenance

        key, local = self._location("regenerated", REGENERATE)
        work = local if local is not None else self.scratch / key
        out = work / REGENERATED
        if (
            local is None
            and self.store.exists(f"{key}/{provenance_path(out).name}")
            and not read_provenance(out)
        ):
            self.store.fetch_dir(key, work)
        work.mkdir(parents=True, exist_ok=True)
        return key, work

    def _reuse_regenerated(self, key: str, work: Path) -> InputFile | None:
        """The finished regeneration in `work` with this job's fingerprint, announced as reused; else None."""
        from peagle_core.regeneration.rewrite import finished_regeneration, regenerated_file

        fp = self._key(REGENERATE)
        prov = finished_regeneration(work / REGENERATED, fp)
        if prov is None:
            return None
        self.cb.log(REGENERATE, f"reusing regenerated data {fp[:12]} ({prov['counts']['written']} conversations)",
                    reused=True, fingerprint=fp, counts=prov["counts"])  # fmt: skip
        self.cb.stored("regenerated", key, work)
        return regenerated_file(work / REGENERATED, prov)

    def _rewrite(self, out: Path) -> RegenReport:
        """Run (or resume) the rewrite into `out`, reporting its progress and ETA; logs a stop."""
        from peagle_core.regeneration.rewrite import params_for_spec, rewrite_dataset

        spec, cb = self.spec, self.cb
        params = params_for_spec(spec)
        resumed = _work_log_rows(out.with_name(out.name + ".parts"))
        cb.event(REGENERATE, "regenerating answers", engine=params.engine,
                 max_new_tokens=params.max_new_tokens, fingerprint=self._key(REGENERATE),
                 resume_from=resumed)  # fmt: skip
        if resumed:
            cb.log(REGENERATE, f"resuming regeneration after {resumed} conversations", resume_from=resumed)
        report = rewrite_dataset(
            spec.verifier.name_or_path,
            self.source,
            out,
            params,
            revision=spec.verifier.revision,
            trust_remote_code=spec.verifier.trust_remote_code,
            on_progress=_regeneration_progress(cb),
            should_stop=cb.should_stop_now or cb.should_stop,
            verifier_fp=self.verifier_fp,
        )
        if report.status == "stopped":
            cb.log(REGENERATE, f"regeneration stopped after {report.conversations} of {report.total} "
                   "conversations", **report.to_dict())  # fmt: skip
        return report

    def _publish_regenerated(self, key: str, work: Path, report: RegenReport) -> InputFile:
        """Announce the finished rewrite, publish it to a remote store, and hand it on as an input."""
        from peagle_core.regeneration.rewrite import read_provenance, regenerated_file

        self.cb.log(
            REGENERATE,
            f"regenerated {report.written} conversations ({report.turns} turns; {report.skipped_prompt_too_long} "
            f"prompts too long, {report.dropped_empty} empty answers dropped, {report.hit_max_new_tokens} hit "
            f"max_new_tokens) at {report.tokens_per_s:.0f} tokens/s",
            **report.to_dict(),
        )
        if self.store.local_path(key) is None:
            self.store.publish_dir(work, key)
        self.cb.stored("regenerated", key, work)
        out = work / REGENERATED
        return regenerated_file(out, read_provenance(out) or {})

    # -- prepare -----------------------------------------------------------------------------------

    def prepare(self, source: InputFile) -> Path | None:
        """The prepared dataset directory, shared by every job with the same stage key; None when a stop
        request ended it."""
        from peagle_core.data.prepare import MANIFEST, PrepareStopped, prepare_for_spec, skipped_rows_note

        self.cb.event(PREPARE, "preparing data")
        key, local = self._location("prepared", PREPARE)
        target = local if local is not None else self.work_dir / "prepared"
        reused = (target / MANIFEST).is_file()
        if not reused and local is None and self.store.exists(f"{key}/{MANIFEST}"):
            self.store.fetch_dir(key, target)
            reused = True
        if reused:
            self.cb.log(PREPARE, "reusing prepared data", reused=True, dataset=key.rsplit("/", 1)[-1][:12])
            self.cb.stored("prepared", key, target)
            return target
        try:
            with atomic_dir(target) as tmp:
                manifest = prepare_for_spec(self.spec, source, tmp, max_line_bytes=self.max_line_bytes,
                                            should_stop=self.cb.should_stop).manifest  # fmt: skip
        except PrepareStopped as stop:
            self.cb.log(PREPARE, f"data preparation {stop}")
            return None
        if (note := skipped_rows_note(manifest)) is not None:
            self.cb.log(PREPARE, note, level="warning", skipped_rows=manifest["skipped_rows"])
        if local is None:
            self.store.publish_dir(target, key)
        self.cb.stored("prepared", key, target)
        return target

    # -- hidden states -----------------------------------------------------------------------------

    def cache_dir(self) -> Path:
        """Where the hidden-state cache is (the trainer builds a missing one as its `hidden_states` stage).

        On a remote store it stays on this machine's scratch; a verifier whose weights changed under the same
        name is caught by the cache's own fingerprint check as well."""
        if self.spec.hidden_states.cache_uri:
            return Path(self.spec.hidden_states.cache_uri)
        key, local = self._location("caches", HIDDEN_STATES)
        path = local if local is not None else self.scratch / key
        self.cb.stored("cache", key, path)  # charged now (a reuse keeps it alive) and again after training
        return path


@contextmanager
def _locked(work: Path) -> Iterator[None]:
    """An exclusive lock on `work` (a `.lock` file in it) for the block: one process at a time."""
    with open(work / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _regeneration_progress(cb: Callbacks) -> Callable[[RegenReport], None]:
    """A rewrite's progress as `cb.on_progress` fields: conversations done of total, speed and ETA."""

    def progress(r: RegenReport) -> None:
        if cb.on_progress is None:
            return
        left = r.total - r.conversations
        rate = (r.conversations - r.resumed_from) / r.seconds if r.seconds > 0 else 0.0
        eta = round(left / rate, 1) if rate > 0 else None
        cb.on_progress({"regenerate": {"done": r.conversations, "total": r.total, "eta_s": eta,
                                       "tokens_per_s": round(r.tokens_per_s, 1)}, "eta_s": eta})  # fmt: skip

    return progress


def _work_log_rows(path: Path) -> int:
    """Conversations an interrupted regeneration already appended (the header line excluded)."""
    if not path.is_file():
        return 0
    return max(0, path.read_bytes().count(b"\n") - 1)
