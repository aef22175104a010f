"""How close `peagle jobs plan`'s stage-time estimates come to the stages measured right after, on the toy.

Calibrates a plan, then runs the same stages (regeneration, training, final evaluation) and prints one JSON
line per stage with the estimate, the measurement and their ratio (the target is within 2x).

    python bench/plan_accuracy.py [--steps 80]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from _common import emit


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=80)
    args = p.parse_args()

    from peagle_core.data.prepare import prepare_for_spec
    from peagle_core.events import CallbackReporter, Event
    from peagle_core.regeneration.rewrite import params_for_spec, rewrite_dataset
    from peagle_core.spec import parse_spec
    from peagle_core.toy import build_toy_verifier, write_toy_dataset
    from peagle_core.training.loop import train
    from peagle_core.training.plan import plan_job

    with tempfile.TemporaryDirectory(prefix="peagle-plan-") as tmp:
        root = Path(tmp)
        verifier = build_toy_verifier("test", seed=0)
        data = write_toy_dataset(root / "chat.jsonl", n=96, seed=2)
        spec = parse_spec({
            "verifier": {"name_or_path": str(verifier)},
            "dataset": {"path": str(data), "seq_len": 128, "val_fraction": 0.25, "regenerate": {"max_new_tokens": 24}},
            "hidden_states": {"mode": "online"},
            "model": {"num_layers": 1, "num_depths": 2, "draft_vocab_size": 256},
            "training": {"epochs": 100, "max_steps": args.steps, "total_seq_len": 256, "checkpoint_every_steps": 1000},
            "evaluation": {"prompts": 24, "max_new_tokens": 48, "engine": "peagle"},
            "export": {"vllm_check": False},
        })  # fmt: skip
        plan, _ = plan_job(spec, data, root / "plan", free_bytes=10**12)

        t0 = time.perf_counter()
        regen_out = root / "regen.jsonl"
        rewrite_dataset(spec.verifier.name_or_path, data, regen_out, params_for_spec(spec))
        measured = {"regenerate": time.perf_counter() - t0}
        prepared = prepare_for_spec(spec, regen_out, root / "prepared").path
        marks: dict[str, float] = {}

        def on_event(event: Event) -> None:
            now = time.perf_counter()
            if event.kind == "eval":
                marks.setdefault("eval", now)
            elif "eval" in marks:
                marks.setdefault("eval_end", now)

        t0 = time.perf_counter()
        train(
            spec, root / "run", resume=False, dataset_dir=prepared, reporter=CallbackReporter(events=on_event)
        )
        measured["train"] = marks["eval"] - t0
        measured["eval"] = marks["eval_end"] - marks["eval"]
        for stage, seconds in measured.items():
            estimate = plan["stages_s"][stage]
            emit(bench="plan_accuracy", stage=stage, estimated_s=estimate, measured_s=round(seconds, 2),
                 ratio=round(estimate / seconds, 3), within_2x=seconds / 2 <= estimate <= 2 * seconds)  # fmt: skip


if __name__ == "__main__":
    main()
