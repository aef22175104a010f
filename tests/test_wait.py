"""The suite's poll-until helper: it returns the first truthy value, and a wait that never ends fails
naming what was awaited, in a thread and in an event loop alike."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.fixtures.wait import until, wait_until


def test_wait_until_returns_the_first_truthy_value() -> None:
    calls = itertools.count()
    assert wait_until(lambda: next(calls) >= 3 and "ready", message="three calls", interval=0) == "ready"


def test_a_wait_past_its_deadline_names_what_it_waited_for() -> None:
    tail = []
    with pytest.raises(AssertionError, match=r"timed out after 0.05 s waiting for the server: log tail"):
        wait_until(lambda: tail.append(1), message=lambda: "the server: log tail", timeout=0.05)
    assert len(tail) >= 2  # polled until the deadline, not checked once


def test_a_predicate_that_raises_ends_the_wait_at_once() -> None:
    def died() -> bool:
        raise AssertionError("the worker exited with 1")

    with pytest.raises(AssertionError, match="the worker exited with 1"):
        wait_until(died, message="never", timeout=60)


def test_until_lets_the_other_tasks_run_and_has_a_deadline() -> None:
    async def scenario() -> None:
        done: list[int] = []

        async def work() -> None:
            for i in range(3):
                done.append(i)
                await asyncio.sleep(0)

        task = asyncio.create_task(work())
        assert await until(lambda: len(done) == 3, message="the task's three steps") is True
        await task
        with pytest.raises(AssertionError, match="waiting for nothing"):
            await until(lambda: False, message="nothing", timeout=0.05)

    asyncio.run(scenario())
