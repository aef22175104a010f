"""`peagle train`'s and the benches' progress (peagle_core.cli.progress): the hidden-state build as a bar over
its tokens, then a bar over the training steps, other events as lines, all on the stream it is given."""

from __future__ import annotations

import io

from peagle_core.cli.progress import RunProgress
from peagle_core.events import Event


def test_the_build_and_the_steps_are_bars_and_other_events_lines() -> None:
    out, seen = io.StringIO(), []
    with RunProgress(out, metrics=seen.append) as progress:
        reporter = progress.reporter()
        reporter.on_event(Event("hidden_states", "hidden states: offline"))
        for done in (0, 3_000, 8_000):
            reporter.on_event(
                Event.log("hidden_states", "building the cache", done=done, total=8_000, unit="tokens")
            )
        assert progress.counted is not None and progress.counted.n == 8_000
        reporter.on_event(Event("train", "training", {"total_steps": 4}))
        assert progress.counted is None  # the next stage closes the build's bar
        for step in (1, 2):
            reporter.on_metrics(
                {"step": step, "total_steps": 4, "loss": 2.0, "lr": 1e-3, "tokens_per_s": 900.0}
            )
        reporter.on_metrics({"step": 2, "eval/acceptance_length@2": 1.5})
        assert progress.steps is not None and progress.steps.n == 2
        reporter.on_event(Event.log("serving", "timing round 1/3", done=0, total=3))  # after training: a line
    text = out.getvalue()
    assert "building the cache" in text and "8.00k/8.00k" in text and "tokens" in text
    assert "[hidden_states] hidden states: offline" in text and "[train] training" in text
    assert "2/4" in text and "loss=2.0000" in text
    assert "step 2: eval/acceptance_length@2 = 1.500" in text and "[serving] timing round 1/3" in text
    assert len(seen) == 3  # the caller's own metrics hook hears every report
    assert progress.steps is None and progress.counted is None  # closed on exit
