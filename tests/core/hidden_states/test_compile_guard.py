"""A module called under `outside_compiles()` on one thread never runs inside another thread's compile,
where torch.fx has swapped `nn.Module.__call__` for its tracer's (the online loader's NameError)."""

from __future__ import annotations

import threading

import torch

from peagle_core.hidden_states.compile_guard import outside_compiles


def test_a_guarded_module_call_waits_out_a_compile_that_is_tracing() -> None:
    tracing, release = threading.Event(), threading.Event()

    def hold(x: torch.Tensor) -> torch.Tensor:
        # Runs while fx traces: nn.Module.__call__ is fx's wrapper for every thread until it returns.
        tracing.set()
        assert release.wait(60)
        return x + 1

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        torch.fx.symbolic_trace(hold)  # as Inductor's first compile traces a bare function
        return gm.forward

    compiled = torch.compile(lambda x: x * 2, backend=backend)
    compiler = threading.Thread(target=compiled, args=(torch.ones(3),))
    compiler.start()
    assert tracing.wait(60)

    layer, outcome = torch.nn.Linear(3, 3), {}

    def forward() -> None:
        try:
            with outside_compiles():
                outcome["out"] = layer(torch.ones(3))
        except Exception as exc:  # unguarded: NameError, module is not installed as a submodule
            outcome["error"] = exc

    caller = threading.Thread(target=forward)
    caller.start()
    caller.join(0.5)
    assert outcome == {}  # still waiting: the compile is tracing
    release.set()
    compiler.join(60)
    caller.join(60)
    assert "error" not in outcome, outcome
    assert outcome["out"].shape == (3,)


def test_a_compile_waits_for_a_guarded_call_in_progress() -> None:
    inside, release, compiled_once = threading.Event(), threading.Event(), threading.Event()

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        compiled_once.set()
        return gm.forward

    def guarded() -> None:
        with outside_compiles():
            inside.set()
            assert release.wait(60)

    holder = threading.Thread(target=guarded)
    holder.start()
    assert inside.wait(60)
    compiler = threading.Thread(target=torch.compile(lambda x: x - 1, backend=backend), args=(torch.ones(2),))
    compiler.start()
    assert not compiled_once.wait(0.5)  # the compile has not begun: a guarded call is running
    release.set()
    holder.join(60)
    compiler.join(60)
    assert compiled_once.is_set()
