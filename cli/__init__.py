"""The `peagle` console script: every package's commands, plus `up` and `demo`.

Each package registers its own commands (peagle_core: the library; service: api, db, keys; worker:
worker, reconcile; client: jobs, checkpoints, datasets). Heavy imports (torch, the app, RQ) happen inside
commands so `peagle --help` stays fast.
"""

from __future__ import annotations

import typer

import client.cli as client_cli
import peagle_core.cli as core_cli
import service.cli as service_cli
import worker.cli as worker_cli
from cli import demo, up


def build_app() -> typer.Typer:
    app = typer.Typer(
        no_args_is_help=True,
        add_completion=False,
        help="peagle: train P-EAGLE speculative-decoding drafters, locally or as a service.",
    )
    core_cli.register(app)
    service_cli.register(app)
    worker_cli.register(app)
    client_cli.register(app)
    up.register(app)
    demo.register(app)
    return app


def main() -> None:
    from peagle_core.cli.common import run_app

    run_app(build_app())
