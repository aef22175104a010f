"""The pipeline's one typed result: how a job ended, its export, evaluation and serving verdict."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from peagle_core.serving.gate import ServingCheck
from peagle_core.serving.report import EvaluationReport


@dataclass
class PipelineResult:
    """How the run ended: where it stopped or what it exported, with the last evaluation and the serving
    verdict the export was published under."""

    status: Literal["completed", "stopped"]
    step: int
    checkpoint_dir: Path | None = None  # the newest training checkpoint
    export_dir: Path | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    evaluation: EvaluationReport | None = None  # the export's eval.json (with `serving`)
    serving: ServingCheck | None = None  # the publish gate's verdict on the export
    model: Any = field(default=None, repr=False, compare=False)  # the trained drafter (this process's copy)

    @classmethod
    def stopped(cls, step: int = 0) -> PipelineResult:
        return cls(status="stopped", step=step)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (the model left out): how torchrun's rank 0 hands its result to the worker."""
        return {
            "status": self.status,
            "step": self.step,
            "checkpoint_dir": str(self.checkpoint_dir) if self.checkpoint_dir else None,
            "export_dir": str(self.export_dir) if self.export_dir else None,
            "metrics": self.metrics,
            "evaluation": self.evaluation.to_dict() if self.evaluation is not None else None,
            "serving": self.serving.to_dict() if self.serving else None,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PipelineResult:
        return cls(
            status=d["status"],
            step=int(d["step"]),
            checkpoint_dir=Path(d["checkpoint_dir"]) if d.get("checkpoint_dir") else None,
            export_dir=Path(d["export_dir"]) if d.get("export_dir") else None,
            metrics=dict(d.get("metrics") or {}),
            evaluation=EvaluationReport.from_dict(d["evaluation"]) if d.get("evaluation") else None,
            serving=ServingCheck.from_dict(d["serving"]) if d.get("serving") else None,
        )
