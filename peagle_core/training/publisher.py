"""The trainer's publishing: rank 0 exports the trained drafter, validated and judged by the publish gate
(vLLM's serving check where it runs), with the evaluation and the verdict in eval.json beside it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from peagle_core.io import atomic_write_json
from peagle_core.model.drafter import PEagleDraftModel
from peagle_core.serving.export import export_checkpoint
from peagle_core.serving.gate import ServingCheck
from peagle_core.serving.report import EvaluationReport
from peagle_core.spec import JobSpec
from peagle_core.training import distributed as dist_utils
from peagle_core.training.evaluator import Evaluator, eval_summary
from peagle_core.training.hooks import Hooks


@dataclass
class Publisher:
    """Writes exports under `root` (out_dir/export) for the run's verifier and data, gated by the evaluator's
    vLLM judge where its evaluators say the gate runs."""

    spec: JobSpec
    root: Path
    hooks: Hooks
    verifier_config: Any
    data_fingerprint: str
    evaluator: Evaluator  # its judge, and the evaluators resolved for the run

    def publish(
        self,
        whole: PEagleDraftModel | None,
        step: int,
        evaluation: EvaluationReport | None,
        loss: float | None,
    ) -> tuple[Path | None, EvaluationReport | None, ServingCheck | None]:
        """Rank 0 writes the validated export of `whole` (the drafter gathered by `sharding.full_model`) to
        root/step_N with eval.json beside it; returns the export directory, its evaluation with the serving
        verdict, and the verdict (None, None, None on other ranks). Every rank calls it."""
        export_dir = published = check = None
        if self.hooks.info.is_main and whole is not None:
            self.hooks.event("export", "exporting the drafter", step=step)
            export_dir = self.root / f"step_{step}"
            summary = {**eval_summary(evaluation), "train/loss": loss}
            k = max(self.spec.speculative_tokens)
            export_checkpoint(
                whole,
                export_dir,
                verifier_name_or_path=self.spec.verifier.name_or_path,
                verifier_config=self.verifier_config,
                data_fingerprint=self.data_fingerprint,
                metrics={k: v for k, v in summary.items() if v is not None},
                speculative_tokens=k,
                dtype=self.spec.export.dtype,
                serving=self._gate(step, evaluation, k),
            )
            check = ServingCheck.load(export_dir)  # the verdict the export was published under
            assert check is not None  # export_checkpoint saves one with every export
            self._announce(step, check, k)
            published = (evaluation or EvaluationReport()).with_serving(check)
            atomic_write_json(export_dir / "eval.json", published.to_dict())
        dist_utils.barrier(self.hooks.info)
        return export_dir, published, check

    def _gate(self, step: int, evaluation: EvaluationReport | None, k: int) -> Callable[[Path], ServingCheck]:
        """The check an export at K must pass to be published: vLLM's (lossless, acceptance not collapsed
        against ours at K, speed-ups when asked) where it runs, else an `unverified` verdict saying why."""
        evaluators, judge = self.evaluator.evaluators, self.evaluator.judge
        if not (evaluators.gate and judge is not None):
            return partial(_unverified, reason=evaluators.gate_off_reason or "no serving check was run")
        self.hooks.event("serving", f"checking the checkpoint in vLLM (K={k})", step=step)
        ours = evaluation.ours(k) if evaluation is not None else None
        return partial(
            judge.gate,
            k=k,
            # The collapse check: vLLM's acceptance against ours at K on the same prompts.
            ours=ours if ours is not None and ours.acceptance_length is not None else None,
            measure_speedup=self.spec.evaluation.measure_speedup,
            speedup_ks=self.spec.speculative_tokens,
            speedup_batch_sizes=self.spec.evaluation.speedup_batch_sizes,
            speedup_rounds=self.spec.evaluation.speedup_rounds,
            # Each timed round as an event with its count: clients show the timing's progress (`peagle jobs logs -f`).
            on_step=lambda label, done, total: self.hooks.event("serving", label, done=done, total=total),
        )

    def _announce(self, step: int, check: ServingCheck, k: int) -> None:
        """A verified export's figures as events and metrics: vLLM's acceptance, speed-up, recommendation."""
        if check.status != "verified":
            return
        self.hooks.event(
            "serving",
            f"vLLM served the checkpoint: acceptance length {check.acceptance_length:.3f} at K={k}",
            serving=check.to_dict(),
        )
        if check.speedup is not None and check.speedup.speedup is not None:
            self.hooks.report({"step": step, f"eval/vllm_speedup@{k}": check.speedup.speedup})
        if (recommendation := check.recommendation) is not None:
            self.hooks.event("serving", recommendation.sentence(), recommendation=recommendation.to_dict())


def _unverified(_checkpoint_dir: Path, reason: str) -> ServingCheck:
    """The publish gate when vLLM does not judge this export (`reason` says why)."""
    return ServingCheck.unverified(reason)
