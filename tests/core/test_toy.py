"""The toy verifier and corpus: loadable through HF, better than chance, deterministic and cached."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from peagle_core.cli import build_app
from peagle_core.toy import MASK, build_corpus, build_toy_verifier, write_toy_dataset


def test_toy_verifier_loads_through_from_pretrained(toy_verifier_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(toy_verifier_dir)
    tokenizer = AutoTokenizer.from_pretrained(toy_verifier_dir)
    info = json.loads((toy_verifier_dir / "toy_verifier.json").read_text())

    assert model.config.model_type == "llama"
    assert model.config.num_hidden_layers >= 4
    assert info["mask_token_id"] == tokenizer.convert_tokens_to_ids(MASK)
    assert info["mask_token_id"] in tokenizer.all_special_ids
    # trained: held-out next-token accuracy far above the uniform-guess rate
    assert info["heldout_next_token_accuracy"] > 20 * info["chance_accuracy"]

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What does json.dumps do?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert tokenizer.decode(ids[0]) == text
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > ids.shape[1]


def test_build_is_cached_and_deterministic(tmp_path: Path, toy_verifier_dir: Path) -> None:
    # One fresh build, compared byte for byte with the session's (another cache, maybe another process).
    first = build_toy_verifier("test", seed=0, cache_dir=tmp_path / "a")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = build_toy_verifier("test", seed=0, cache_dir=tmp_path / "a")
    assert again == first
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rebuilt

    other = toy_verifier_dir
    assert other.parent != first.parent
    assert (other / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()

    copy = build_toy_verifier("test", seed=0, cache_dir=tmp_path / "a", out=tmp_path / "copy")
    assert copy == tmp_path / "copy"
    assert (copy / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]


def test_corpus_is_deterministic_and_well_formed() -> None:
    corpus = build_corpus(0)
    assert corpus == build_corpus(0)
    assert corpus != build_corpus(1)
    assert len(corpus) > 500
    for conv in corpus:
        roles = [m["role"] for m in conv["messages"]]
        assert set(roles) <= {"system", "user", "assistant"}
        assert roles[-1] == "assistant"
        assert all(m["content"] == " ".join(m["content"].split()) for m in conv["messages"])
    assert any(sum(m["role"] == "assistant" for m in c["messages"]) >= 2 for c in corpus)
    answers = [
        c["messages"][i + 1]["content"]
        for c in corpus
        for i, m in enumerate(c["messages"][:-1])
        if m["role"] == "user" and "json.dumps" in m["content"].split()[-1]
    ]
    assert answers and all("JSON" in a for a in answers)


def test_corpus_does_not_depend_on_what_the_process_imported(monkeypatch) -> None:
    import inspect

    from peagle_core.toy import stdlib_docs

    def getfile(obj):
        """Return the file an object was defined in."""
        return "x"

    # torch replaces inspect.getfile on import: the corpus must be the same before and after.
    getfile.__module__ = "inspect"
    monkeypatch.setattr(inspect, "getfile", getfile)
    native = stdlib_docs()
    getfile.__module__ = "torch.package.package_importer"
    assert stdlib_docs() == native


def test_toy_cli_writes_dataset(tmp_path: Path) -> None:
    out = tmp_path / "toy.jsonl"
    result = CliRunner().invoke(build_app(), ["toy", "dataset", "--out", str(out), "--n", "10"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["rows"] == 10
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 10 and all("messages" in r for r in rows)
    assert out.read_bytes() == write_toy_dataset(tmp_path / "again.jsonl", n=10).read_bytes()


def test_corpus_is_pinned_not_read_from_the_interpreter(monkeypatch, tmp_path: Path) -> None:
    """Docstrings differ between Python patch releases; the corpus (and the toy verifier) must not."""
    import peagle_core.toy as toy

    corpus = build_corpus(0)
    monkeypatch.setattr(
        toy, "stdlib_docs", lambda: pytest.fail("the corpus read this interpreter's docstrings")
    )
    assert build_corpus(0) == corpus
    monkeypatch.undo()
    toy.pin_docs(tmp_path / "docs.json")  # the recipe still writes the pinned file's format
    assert [tuple(p) for p in json.loads((tmp_path / "docs.json").read_text())] == toy.stdlib_docs()
