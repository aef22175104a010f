"""Errors a user can act on: each carries a stable `code` and a message naming what is wrong.

The worker stores `{code, message}` on a failed job and the CLI prints the message on one line,
so every expected failure in peagle_core raises one of these instead of a bare exception.
"""

from __future__ import annotations


class PeagleError(Exception):
    """Base class: `code` is machine-readable, `param` optionally names the offending field or file."""

    code: str = "peagle_error"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.param = param

    def to_dict(self) -> dict[str, str | None]:
        return {"code": self.code, "message": self.message, "param": self.param}


class DataError(PeagleError):
    """Bad training data: malformed JSON, unknown role, empty conversation, no trainable tokens."""

    code = "invalid_data"


class VerifierError(PeagleError):
    """The verifier cannot be loaded or does not fit (missing path, unsupported architecture)."""

    code = "verifier_unavailable"


class CacheError(PeagleError):
    """A hidden-state cache that is missing, corrupt, or built for another verifier/data/layers."""

    code = "cache_error"


class TrainingDiverged(PeagleError):
    """The loss stayed NaN or infinite for `training.max_nonfinite_steps` steps in a row."""

    code = "diverged"


class CheckpointError(PeagleError):
    """A checkpoint that fails validation; `problems` lists every reason."""

    code = "invalid_checkpoint"

    def __init__(self, problems: list[str], *, path: str | None = None, param: str | None = None):
        self.problems = list(problems)
        where = f"{path}: " if path else ""
        super().__init__(where + "; ".join(self.problems), param=param or path)


class StopRequested(Exception):
    """A long stage ended early because its caller's `should_stop` asked (a cancel, a shutdown, a time
    limit); what it had finished is kept, nothing is half-written."""
