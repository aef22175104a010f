"""The library's own commands (`peagle toy|models|data|cache|train|eval|export|recipes`), usable without the
service.

Each command group lives in its own module and imports torch only inside its commands, so
`peagle --help` stays fast. `service.cli` mounts these groups under the full `peagle` CLI.
"""

from __future__ import annotations

import typer

from peagle_core.cli import cache, catalogue, data, export, recipes, toy, train


def register(app: typer.Typer) -> None:
    """Mount the core command groups on `app`."""
    app.add_typer(toy.app, name="toy")
    app.add_typer(catalogue.models_app, name="models")
    app.add_typer(data.app, name="data")
    app.add_typer(cache.app, name="cache")
    app.add_typer(export.app, name="export")
    train.register(app)
    recipes.register(app)


def build_app() -> typer.Typer:
    app = typer.Typer(
        no_args_is_help=True, add_completion=False, help="P-EAGLE drafter training (library CLI)."
    )
    register(app)
    # The full CLI mounts `datasets get` on the client's `datasets` group; standalone, it gets its own.
    datasets = typer.Typer(no_args_is_help=True, help="Catalogue datasets.")
    datasets.command("get")(catalogue.datasets_get)
    datasets.command("catalogue")(catalogue.datasets_catalogue)
    app.add_typer(datasets, name="datasets")
    return app


def main() -> None:
    from peagle_core.cli.common import run_app

    run_app(build_app())
