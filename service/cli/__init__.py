"""The `peagle` console script: library commands, the server side (api, db, keys, up) and the client.

Heavy imports (torch, the app, RQ) happen inside commands so `peagle --help` stays fast.
"""

from __future__ import annotations

import typer

import peagle_core.cli as core_cli
from service.cli import client, server
from worker import cli as worker_cli


def build_app() -> typer.Typer:
    app = typer.Typer(
        no_args_is_help=True,
        add_completion=False,
        help="peagle: train P-EAGLE speculative-decoding drafters, locally or as a service.",
    )
    core_cli.register(app)
    server.register(app)
    worker_cli.register(app)
    client.register(app)
    return app


def main() -> None:
    from peagle_core.cli.common import run_app

    run_app(build_app())
