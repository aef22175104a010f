"""Named, versioned training recipes shipped with the package (`<name>.yaml` beside this module): the one
place a measured recipe's values live, turned into a job spec for the demo and the benches."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peagle_core.documents import load_yaml
from peagle_core.errors import PeagleError

RECIPES_DIR = Path(__file__).resolve().parent
DEFAULT_RECIPE = "smollm2-cpu"


class RecipeError(PeagleError, ValueError):
    """A recipe that is not shipped, or a recipe file that is not well formed."""

    code = "bad_recipe"


@dataclass(frozen=True)
class Recipe:
    """One preset: the catalogue material it trains on, its data and evaluation budgets, and `spec`, a job
    spec lacking only the verifier's path, the dataset and the evaluation prompts."""

    name: str
    version: int
    description: str
    verifier: str  # a catalogue model
    dataset: str  # a catalogue dataset, whole conversations as written
    train_tokens: int  # conversations taken in order until this many tokens within dataset.seq_len
    eval_dataset: str
    eval_prompts: int
    spec: Mapping[str, Any] = field(repr=False)
    headline_command: str = ""
    headline_figure: str = ""

    @property
    def label(self) -> str:
        """`name@version`, how a figure names the recipe it was measured with."""
        return f"{self.name}@{self.version}"

    def value(self, path: str) -> Any:
        """One spec value by its dotted path, e.g. `training.optimizer`."""
        node: Any = self.spec
        for part in path.split("."):
            node = node[part]
        return node

    def job_spec(
        self,
        verifier_path: str,
        *,
        dataset_path: str | None = None,
        dataset_id: str | None = None,
        eval_prompts: list[Any] | None = None,
        name: str | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The job spec (a dict `peagle_core.spec.parse_spec` takes) for this recipe on local material;
        `overrides` are dotted paths (`training.max_steps`) set on top, each a deliberate departure."""
        spec = {"name": name or self.label, **copy.deepcopy(dict(self.spec))}
        spec["verifier"] = {**spec.get("verifier", {}), "name_or_path": verifier_path}
        source = {"path": dataset_path} if dataset_path is not None else {"id": dataset_id}
        spec["dataset"] = {**source, **spec.get("dataset", {})}
        spec.setdefault("evaluation", {})["prompts"] = (
            eval_prompts if eval_prompts is not None else self.eval_prompts
        )
        for path, value in (overrides or {}).items():
            set_path(spec, path, value)
        return spec


def set_path(tree: dict[str, Any], path: str, value: Any) -> None:
    """Set `tree[a][b]... = value` for the dotted `path` `a.b...`, making the sections it lacks."""
    *parents, leaf = path.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def recipe_names() -> list[str]:
    """The shipped recipes, sorted."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def load_recipe(name: str = DEFAULT_RECIPE) -> Recipe:
    """A shipped recipe by name (RecipeError naming the known ones when it is not shipped)."""
    path = RECIPES_DIR / f"{name}.yaml"
    if not path.is_file():
        raise RecipeError(f"no recipe {name!r}; shipped: {', '.join(recipe_names())}")
    return parse_recipe(load_yaml(path.read_text()), where=path.name)


def parse_recipe(raw: Any, *, where: str = "recipe") -> Recipe:
    """A recipe from its document; a missing or mistyped field is a RecipeError naming it."""

    def need(tree: Any, key: str, kind: type | tuple[type, ...], prefix: str = "") -> Any:
        value = tree.get(key) if isinstance(tree, Mapping) else None
        if not isinstance(value, kind) or isinstance(value, bool):
            raise RecipeError(
                f"{where}: `{prefix}{key}` is missing or not a {getattr(kind, '__name__', kind)}"
            )
        return value

    data, evaluation = need(raw, "data", Mapping), need(raw, "evaluation", Mapping)
    headline = raw.get("headline") or {}
    return Recipe(
        name=need(raw, "name", str),
        version=need(raw, "version", int),
        description=str(raw.get("description", "")).strip(),
        verifier=need(raw, "verifier", str),
        dataset=need(data, "dataset", str, "data."),
        train_tokens=need(data, "train_tokens", int, "data."),
        eval_dataset=need(evaluation, "dataset", str, "evaluation."),
        eval_prompts=need(evaluation, "prompts", int, "evaluation."),
        spec=need(raw, "spec", Mapping),
        headline_command=str(headline.get("command", "")),
        headline_figure=str(headline.get("figure", "")).strip(),
    )
