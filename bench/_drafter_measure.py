"""Every drafter of a comparison measured the same way by the product's judge: vLLM's acceptance length per
position on MT-Bench first turns (fp32, lossless against plain greedy), our evaluator's beside it, and the
paired batch-1 speed-ups against plain decoding and vLLM's ngram; and the comparison's table."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from _common import emit


def add_measure_args(p: argparse.ArgumentParser) -> None:
    """The options `Measure` reads: which prompts, how many timed, how long each answer, whose evaluator."""
    p.add_argument("--eval-prompts", type=int, default=80, help="MT-Bench first turns (80 = all)")
    p.add_argument("--timing-prompts", type=int, default=16, help="of those, timed for speed-ups (0: none)")
    p.add_argument("--rounds", type=int, default=2, help="paired timing rounds")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--ours-eval",
        default="first",
        choices=["first", "all", "none"],
        help="which drafters our own evaluator also scores (vLLM scores every one)",
    )


class Measure:
    """Every drafter measured the same way: vLLM's acceptance (fp32, lossless) and ours on the evaluation
    prompts, and paired bf16 batch-1 speed-ups against plain and ngram on the timing prompts."""

    def __init__(
        self,
        args: argparse.Namespace,
        verifier_dir: Path,
        prompts: list[dict[str, str]],
        *,
        bench: str,
        k: int,
    ):
        from peagle_core.hidden_states.verifier import Verifier

        self.args, self.bench, self.k = args, bench, k
        self.verifier_dir = verifier_dir
        self.verifier = Verifier.load(str(verifier_dir), device="cpu")
        self.prompts = [_chat_ids(self.verifier.tokenizer, p["prompt"]) for p in prompts]
        self.categories = [p.get("category") for p in prompts]
        self._eval = self._timing = None
        self._ours_done = False

    def __enter__(self) -> Measure:
        return self

    def __exit__(self, *exc: object) -> None:
        for judge in (self._eval, self._timing):
            if judge is not None:
                judge.close()

    def __call__(self, name: str, export_dir: Path, **extra: Any) -> dict[str, Any]:
        from peagle_core.evaluation.acceptance import evaluate
        from peagle_core.figures import Acceptance
        from peagle_core.model.drafter import PEagleDraftModel

        row: dict[str, Any] = {"drafter": name, "export": str(export_dir), **extra}
        mine = None
        if self.args.ours_eval == "all" or (self.args.ours_eval == "first" and not self._ours_done):
            drafter = PEagleDraftModel.from_pretrained(export_dir).eval()
            tensors = [torch.tensor(p) for p in self.prompts]
            with torch.inference_mode():
                mine = evaluate(drafter, self.verifier, tensors, self.k, self.args.new_tokens).to_dict()
            row["ours_acceptance_length"] = round(float(mine["acceptance_length"]), 4)
            row["ours_rate_per_position"] = mine.get("acceptance_rate_per_position")
            self._ours_done = True
        if not self.args.dry_run:
            row.update(self._in_vllm(export_dir, Acceptance.from_dict(mine) if mine else None))
        emit(bench=self.bench, **row)
        return row

    def _in_vllm(self, export_dir: Path, ours: Any) -> dict[str, Any]:
        from peagle_core.errors import PeagleError
        from peagle_core.model.precision import vllm_dtype
        from peagle_core.serving.judge import VllmJudge

        if self._eval is None:
            self._eval = VllmJudge(str(self.verifier_dir), self.prompts, self.args.new_tokens,
                                   options={"dtype": "float32"}, categories=self.categories)  # fmt: skip
            timing = self.prompts[: self.args.timing_prompts]
            # Timed in what users serve here: bf16 where it is fast (the product's rule), else fp32.
            self._timing = VllmJudge(str(self.verifier_dir), timing, self.args.new_tokens,
                                     options={"dtype": "float32"}, timing_dtype=vllm_dtype("auto", "cpu"))  # fmt: skip
        try:
            check = self._eval.gate(export_dir, self.k, ours=ours)
            out: dict[str, Any] = {
                "vllm_acceptance_length": check.acceptance_length,
                "vllm_rate_per_position": check.acceptance_rate_per_position,
                "lossless": f"{check.prompts}/{len(self.prompts)}",
            }
        except PeagleError as exc:  # not lossless, or vLLM clearly below ours: recorded, not fatal
            out = {"vllm_error": str(exc)[:400], "lossless": None}
        if self.args.timing_prompts:
            rows = self._timing.measure_speedup(
                export_dir, [self.k], batch_sizes=(1,), rounds=self.args.rounds
            )
            for r in rows:  # vLLM serves our drafters under its method name "eagle3"
                out["ngram_speedup" if r.method == "ngram" else "drafter_speedup"] = r.speedup
        return out


def _chat_ids(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


MEASURED = ["vllm_acceptance_length", "vllm_rate_per_position", "ours_acceptance_length", "lossless",
            "drafter_speedup", "ngram_speedup"]  # fmt: skip


def table(rows: list[dict[str, Any]], cols: list[str] | None = None) -> str:
    cols = cols or ["drafter", "steps", "train_s", *MEASURED]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)
