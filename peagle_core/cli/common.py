"""Shared CLI behaviour: expected failures print one readable line and exit non-zero, never a traceback."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from peagle_core.errors import PeagleError

# Options several commands share, declared once.
VerifierOption = Annotated[str, typer.Option("--verifier", help="Verifier: local HF directory or hub id.")]
RevisionOption = Annotated[str | None, typer.Option("--revision", help="Hub revision of the verifier.")]
TrustRemoteCodeOption = Annotated[bool, typer.Option("--trust-remote-code")]


def fail(message: str, code: int = 1) -> None:
    """Print `error: message` to stderr and exit with `code`."""
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code)


def run_app(app: typer.Typer) -> None:
    """Run a typer app, turning PeagleError (and Ctrl-C) into one line on stderr."""
    try:
        # standalone_mode=False returns typer.Exit's code instead of raising it.
        rc = app(standalone_mode=False)
        sys.exit(rc if isinstance(rc, int) else 0)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except PeagleError as exc:
        typer.secho(f"error: {exc.message}", err=True, fg=typer.colors.RED)
        sys.exit(1)
    except KeyboardInterrupt:
        typer.secho("interrupted", err=True)
        sys.exit(130)
    except Exception as exc:
        # Usage errors (missing argument, bad option) come from typer's bundled click, or click itself.
        for exceptions in _click_exception_modules():
            if isinstance(exc, exceptions.ClickException):
                exc.show()
                sys.exit(exc.exit_code)
            if isinstance(exc, exceptions.Abort):
                sys.exit(1)
        raise


def _click_exception_modules() -> list:
    mods = []
    try:
        from typer._click import exceptions as typer_click

        mods.append(typer_click)
    except ImportError:
        pass
    from click import exceptions as click_exceptions

    mods.append(click_exceptions)
    return mods
