"""The trainer's evaluation: acceptance length on the held-out prompts, by our decoder and/or vLLM's
spec-decode counters (`evaluation.engine`), every `training.eval_every_steps` and at the end."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from peagle_core.data import PreparedDataset
from peagle_core.evaluation.acceptance import evaluate
from peagle_core.figures import Acceptance, KResult
from peagle_core.hidden_states.verifier import Verifier
from peagle_core.model.drafter import PEagleDraftModel
from peagle_core.serving.categories import category_groups, per_category, pool_eval
from peagle_core.serving.judge import GAP_TOLERANCE, Evaluators, VllmJudge, agreement_gap
from peagle_core.serving.report import EvaluationReport
from peagle_core.spec import JobSpec
from peagle_core.training import sharding
from peagle_core.training.builders import build_judge, eval_categories, heldout_prompt_tokens
from peagle_core.training.hooks import Hooks


@dataclass
class Evaluator:
    """Evaluates the drafter on `prompts` (rank 0 reports); owns the vLLM judge, which the publish gate
    borrows."""

    spec: JobSpec
    hooks: Hooks
    verifier: Verifier
    prompts: list[torch.Tensor]
    categories: list[str | None] = field(default_factory=list)  # per prompt, where they have one
    # Who measures acceptance length and whether the vLLM publish gate runs (`build` resolves the spec's).
    evaluators: Evaluators = field(
        default_factory=lambda: Evaluators(
            ours=True, vllm=False, gate_off_reason="no serving check configured"
        )
    )
    judge: VllmJudge | None = None  # vLLM on the evaluation prompts (rank 0, when `evaluators` needs it)

    @classmethod
    def build(
        cls,
        spec: JobSpec,
        dataset: PreparedDataset,
        val_idx: list[int],
        verifier: Verifier,
        device: torch.device,
        hooks: Hooks,
    ) -> Evaluator:
        """The spec's evaluation prompts (held out from `val_idx`, or its own) and evaluators."""
        prompts = heldout_prompt_tokens(spec, dataset, val_idx, verifier)
        categories = eval_categories(spec, dataset, val_idx)
        evaluators, judge = build_judge(
            spec, prompts, device, is_main=hooks.info.is_main, categories=categories
        )
        return cls(spec, hooks, verifier, prompts, categories, evaluators, judge)

    def close(self) -> None:
        if self.judge is not None:
            self.judge.close()

    def maybe_evaluate(self, model: PEagleDraftModel, step: int, total_steps: int) -> EvaluationReport | None:
        """Evaluate every `eval_every_steps` and at the last step; returns this step's report (else None)."""
        every = self.spec.training.eval_every_steps
        due = (every is not None and step % every == 0) or step >= total_steps
        if not due:
            return None
        return self.evaluate(model, step, final=step >= total_steps)

    def evaluate(self, model: PEagleDraftModel, step: int, *, final: bool = True) -> EvaluationReport | None:
        """Acceptance length at every evaluated K with the trained `model` (gathered whole first: a collective
        under FSDP) on rank 0; None elsewhere, or without prompts. Ours, vLLM's, or both, with a warning when
        the two disagree. Only the final evaluation is the `eval` stage; one mid-training is an `evaluation`
        event within `train`."""
        if not self.prompts:
            return None
        whole = sharding.full_model(model, self.hooks.info)
        if whole is None or not self.hooks.info.is_main:
            return None
        ks = self.spec.speculative_tokens
        # The event names them as `evaluation.engine` does ("peagle" is ours).
        engines = [
            name for name, on in (("peagle", self.evaluators.ours), ("vllm", self.evaluators.vllm)) if on
        ]
        self.hooks.event(
            "eval" if final else "evaluation",
            f"evaluating at step {step}",
            prompts=len(self.prompts),
            engines=engines,
        )
        report = EvaluationReport(step=step, results={k: KResult(k) for k in ks})
        if self.evaluators.ours:
            for k in ks:
                self._evaluate_ours(whole, step, k, report.results[k])
        if self.evaluators.vllm and self.judge is not None:
            figures = self.judge.evaluate_model(whole, ks, verifier_config=self.verifier.config)
            for k, fig in figures.items():
                report.results[k].vllm = fig
            self._report_vllm(step, report)
        return report

    def _evaluate_ours(self, whole: PEagleDraftModel, step: int, k: int, into: KResult) -> None:
        """Our figures at K into `into`, reported as metrics."""
        r, categories = self._ours(whole, k)
        into.ours = replace(r, categories=categories or None)
        self.hooks.report(
            {"step": step, f"eval/acceptance_length@{k}": r.acceptance_length}
            | per_position_metrics("eval/acceptance_rate", k, r.rates)
        )

    def _ours(self, whole: PEagleDraftModel, k: int) -> tuple[Acceptance, dict[str, Acceptance]]:
        """Our evaluator at K on the evaluation prompts, and its figures per category where prompts have one
        (each category decoded apart, then pooled: the pooled figures are the ungrouped ones)."""
        eos = self.verifier.tokenizer.eos_token_id
        n = self.spec.evaluation.max_new_tokens
        groups = category_groups(self.categories)
        if not groups:
            return evaluate(whole, self.verifier, self.prompts, k, n, eos), {}
        parts = {
            name: evaluate(whole, self.verifier, [self.prompts[i] for i in ix], k, n, eos)
            for name, ix in groups.items()
        }
        return pool_eval(parts, groups), per_category(parts)

    def _report_vllm(self, step: int, report: EvaluationReport) -> None:
        """Report vLLM's acceptance length per K, and warn when it and ours differ by more than 3%."""
        for k, r in report.results.items():
            theirs = r.vllm.acceptance_length if r.vllm is not None else None
            if r.vllm is None or theirs is None:
                continue
            self.hooks.report(
                {"step": step, f"eval/vllm_acceptance_length@{k}": theirs}
                | per_position_metrics("eval/vllm_acceptance_rate", k, r.vllm.rates)
            )
            ours = r.ours.acceptance_length if r.ours is not None else None
            if ours is not None and agreement_gap(ours, theirs) > GAP_TOLERANCE:
                self.hooks.event(
                    "eval_gap",
                    f"acceptance length at K={k} is {ours:.3f} here but {theirs:.3f} in vLLM "
                    f"(gap over {GAP_TOLERANCE:.0%}; both run the same greedy chain)",
                    level="warning",
                    k=k,
                    ours=ours,
                    vllm=theirs,
                )


def per_position_metrics(prefix: str, k: int, rates: list[float]) -> dict[str, float]:
    """`{prefix}@K_pos1`, ...: the share of drafts accepted up to each position, as metric-row scalars."""
    return {f"{prefix}@{k}_pos{j + 1}": rate for j, rate in enumerate(rates)}


def eval_summary(report: EvaluationReport | None) -> dict[str, float]:
    """An evaluation's headline figures as metrics: acceptance length per K (ours, vLLM's), the speed-up."""
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
