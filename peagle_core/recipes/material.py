"""A recipe's training material from the catalogue: its verifier, and its dataset's whole conversations
taken in order until a token budget (`peagle_core.data.budget`), written once per budget and reused."""

from __future__ import annotations

import json
from pathlib import Path

from peagle_core.data.budget import BudgetedData
from peagle_core.recipes.preset import Recipe


def verifier_dir(recipe: Recipe) -> Path:
    """The recipe's verifier, built from its pinned wheel (fp32; `verifier.dtype` picks the engines')."""
    from peagle_core.catalogue.models import get_model

    return get_model(recipe.verifier, dtype="float32")


def training_data(
    recipe: Recipe, out_dir: Path, *, train_tokens: int | None = None, seq_len: int | None = None
) -> BudgetedData:
    """Whole conversations of the recipe's dataset, as written, until `train_tokens` (the recipe's unless
    given) within `seq_len` (the recipe's `dataset.seq_len` unless given), in `out_dir`; a file made
    before for the same budget is reused with its figures."""
    from transformers import AutoTokenizer

    from peagle_core.catalogue.datasets import fetch_catalogue_dataset
    from peagle_core.data.budget import take_conversations

    tokens = train_tokens if train_tokens is not None else recipe.train_tokens
    length = seq_len if seq_len is not None else int(recipe.value("dataset.seq_len"))
    out = Path(out_dir) / f"{recipe.dataset}-tokens-{tokens}-len{length}.jsonl"
    figures = out.with_suffix(".figures.json")  # written last: its presence says the file is whole
    if out.is_file() and figures.is_file():
        return BudgetedData(**{**json.loads(figures.read_text()), "path": out})
    source, _ = fetch_catalogue_dataset(recipe.dataset)
    tokenizer = AutoTokenizer.from_pretrained(str(verifier_dir(recipe)))
    out.parent.mkdir(parents=True, exist_ok=True)
    data = take_conversations(tokenizer, source, out, budget_tokens=tokens, seq_len=length)
    figures.write_text(json.dumps(data.to_dict()))
    return data
