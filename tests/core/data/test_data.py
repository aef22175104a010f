"""Data preparation: exact assistant masks, the three input formats, named errors, the prepared directory."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from peagle_core.cli import build_app
from peagle_core.data import PreparedDataset, prepare_dataset, validate_jsonl
from peagle_core.data.chat import has_generation_markers, tokenize_conversation
from peagle_core.data.prepare import PrepareStopped, skipped_rows_note
from peagle_core.data.vocab import build_draft_vocab
from peagle_core.errors import DataError

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What does math.sqrt do?"},
    {"role": "assistant", "content": "Return the square root of x."},
    {"role": "user", "content": "And math.cos?"},
    {"role": "assistant", "content": "Return the cosine of x (measured in radians)."},
]
SHAREGPT = {
    "conversations": [
        {"from": "system", "value": CONV[0]["content"]},
        {"from": "human", "value": CONV[1]["content"]},
        {"from": "gpt", "value": CONV[2]["content"]},
        {"from": "human", "value": CONV[3]["content"]},
        {"from": "gpt", "value": CONV[4]["content"]},
    ]
}


@pytest.fixture(scope="module")
def tokenizer(toy_verifier_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(toy_verifier_dir)


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_multi_turn_mask_covers_exactly_the_assistant_turns(tokenizer) -> None:
    assert not has_generation_markers(tokenizer)  # the toy template exercises the prefix-rendering path
    ids, mask = tokenize_conversation(tokenizer, CONV)

    assert (
        ids
        == tokenizer(tokenizer.apply_chat_template(CONV, tokenize=False), add_special_tokens=False)[
            "input_ids"
        ]
    )
    spans = _spans(mask)
    assert [tokenizer.decode(ids[s:e]) for s, e in spans] == [
        "Return the square root of x.<|end|>",
        "Return the cosine of x (measured in radians).<|end|>",
    ]
    # everything else, including the role markers that open the assistant turns, is unmasked
    assert tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m]) == (
        "<|bos|><|system|>\nBe brief.<|end|><|user|>\nWhat does math.sqrt do?<|end|><|assistant|>\n"
        "<|user|>\nAnd math.cos?<|end|><|assistant|>\n"
    )


def test_generation_markers_path_agrees_with_prefix_rendering(tokenizer) -> None:
    import copy

    marked = copy.deepcopy(tokenizer)
    marked.chat_template = (
        "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
        "{% else %}{{ message['content'] }}<|end|>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    assert has_generation_markers(marked)
    assert tokenize_conversation(marked, CONV) == tokenize_conversation(tokenizer, CONV)


def test_messages_and_sharegpt_prepare_identically(toy_verifier_dir: Path, tokenizer, tmp_path: Path) -> None:
    msgs = _write(tmp_path / "m.jsonl", [{"messages": CONV}] * 3)
    share = _write(tmp_path / "s.jsonl", [SHAREGPT] * 3)
    a = prepare_dataset(toy_verifier_dir, msgs, tmp_path / "a", seq_len=256)
    b = prepare_dataset(toy_verifier_dir, share, tmp_path / "b", seq_len=256)
    assert a.manifest["source_format"] == "messages" and b.manifest["source_format"] == "sharegpt"
    assert len(a) == len(b) == 3
    for i in range(3):
        assert torch.equal(a[i][0], b[i][0]) and torch.equal(a[i][1], b[i][1])
    ids, mask = b[0]
    assert tokenizer.decode(ids[mask.bool()]) == (
        "Return the square root of x.<|end|>Return the cosine of x (measured in radians).<|end|>"
    )


def test_tokenized_rows_pass_through(toy_verifier_dir: Path, tmp_path: Path) -> None:
    rows = [
        {"input_ids": [1, 5, 6, 7, 8], "loss_mask": [0, 0, 0, 1, 1]},
        {"input_ids": [1, 9, 9, 9], "loss_mask": [0, 0, 1, 1]},
    ]
    ds = prepare_dataset(toy_verifier_dir, _write(tmp_path / "t.jsonl", rows), tmp_path / "out", seq_len=16)
    assert ds.manifest["source_format"] == "tokenized"
    assert ds[0][0].tolist() == [1, 5, 6, 7, 8] and ds[0][1].tolist() == [0, 0, 0, 1, 1]
    assert ds.lengths == [5, 4]
    assert ds.manifest["num_tokens"] == 9 and ds.manifest["num_loss_tokens"] == 4


def test_prepared_dataset_manifest_and_vocab(
    prepared_dataset: Path, toy_verifier_dir: Path, toy_dataset_path: Path
) -> None:
    ds = PreparedDataset.open(prepared_dataset)
    m = ds.manifest
    assert m["num_samples"] == len(ds) == len(toy_dataset_path.read_text().splitlines())
    assert m["num_tokens"] == sum(ds.lengths)
    assert m["num_loss_tokens"] == sum(int(ds[i][1].sum()) for i in range(len(ds)))
    assert max(ds.lengths) <= m["seq_len"]
    assert (
        ds.mask_token_id == json.loads((toy_verifier_dir / "toy_verifier.json").read_text())["mask_token_id"]
    )
    assert len(m["fingerprint"]) == 64
    # draft vocabulary: target_id = i + d2t[i], exactly the ids t2d marks, the most frequent targets
    assert ds.d2t.dtype == torch.int64 and ds.t2d.dtype == torch.bool
    assert ds.d2t.numel() == m["draft_vocab_size"] == int(ds.t2d.sum())
    assert ds.t2d.numel() == m["verifier_vocab_size"]
    targets = torch.arange(ds.d2t.numel()) + ds.d2t
    assert torch.equal(targets, ds.t2d.nonzero().flatten())
    counts = torch.zeros(ds.t2d.numel(), dtype=torch.long)
    for i in range(len(ds)):
        ids, mask = ds[i]
        counts += torch.bincount(ids[mask.bool()], minlength=counts.numel())
    assert counts[ds.t2d].min() >= counts[~ds.t2d].max()
    # split: seeded, disjoint, complete
    train, val = ds.split(0.1, seed=3)
    assert (train, val) == ds.split(0.1, seed=3)
    assert sorted(train + val) == list(range(len(ds))) and val and not set(train) & set(val)


def test_fingerprint_tracks_inputs(toy_verifier_dir: Path, toy_dataset_path: Path, tmp_path: Path) -> None:
    a = prepare_dataset(toy_verifier_dir, toy_dataset_path, tmp_path / "a", seq_len=64, max_samples=8)
    again = prepare_dataset(toy_verifier_dir, toy_dataset_path, tmp_path / "a2", seq_len=64, max_samples=8)
    other = prepare_dataset(toy_verifier_dir, toy_dataset_path, tmp_path / "b", seq_len=96, max_samples=8)
    assert len(a) == 8
    assert a.fingerprint == again.fingerprint != other.fingerprint


def test_draft_vocab_identity_and_ties() -> None:
    d2t, t2d = build_draft_vocab(torch.tensor([5, 0, 5, 1]), None)
    assert d2t.tolist() == [0, 0, 0, 0] and t2d.all()
    d2t, t2d = build_draft_vocab(torch.tensor([5, 0, 5, 1]), 8)
    assert d2t.numel() == 4 and t2d.all()
    d2t, t2d = build_draft_vocab(torch.tensor([1, 7, 0, 7, 3]), 3)
    assert t2d.tolist() == [False, True, False, True, True]
    assert (torch.arange(3) + d2t).tolist() == [1, 3, 4]


BAD_ROWS = [
    ([{"messages": CONV}, '{"messages": [', {"messages": CONV}], "line 2: malformed JSON"),
    (
        [{"messages": CONV}, {"messages": [{"role": "robot", "content": "hi"}]}],
        "line 2: messages[0]: unknown role 'robot'",
    ),
    ([{"messages": []}], "line 1: empty conversation"),
    ([{"messages": [{"role": "system", "content": "x"}]}], "line 1: empty conversation"),
    ([{"messages": CONV}, {"messages": [{"role": "user", "content": "hi"}]}], "line 2: no assistant turn"),
    (
        [{"messages": CONV}, "", {"messages": [{"role": "user"}]}],
        "line 3: messages[0] has no 'content' string",
    ),
    (
        [{"conversations": [{"from": "alien", "value": "x"}]}],
        "line 1: conversations[0]: unknown role 'alien'",
    ),
    ([{"messages": CONV}, SHAREGPT], "line 2: expected a messages row"),
    ([{"input_ids": [1, 2, 3], "loss_mask": [0, 1]}], "line 1: 'loss_mask' has 2 entries"),
    ([{"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]}], "line 1: 'loss_mask' is all zeros"),
    (["[1, 2]"], "line 1: cannot detect the format"),
]


@pytest.mark.parametrize(("rows", "message"), BAD_ROWS)
def test_bad_input_names_the_line(rows: list, message: str, tmp_path: Path) -> None:
    path = _write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace("[", r"\[")) as exc:
        validate_jsonl(path)
    assert exc.value.code == "invalid_data"
    # the same bytes streamed in as a binary file object (the upload path)
    with pytest.raises(DataError, match=r"^line \d+"):
        validate_jsonl(io.BytesIO(path.read_bytes()))


def test_validate_reports_rows_and_format(tmp_path: Path) -> None:
    path = _write(tmp_path / "ok.jsonl", [SHAREGPT, "", SHAREGPT])
    report = validate_jsonl(io.BytesIO(path.read_bytes()))
    assert (report.rows, report.format, report.assistant_turns) == (2, "sharegpt", 4)
    with pytest.raises(DataError, match="no rows"):
        validate_jsonl(io.BytesIO(b"\n\n"))
    with pytest.raises(DataError, match="line 1: expected a tokenized row"):
        validate_jsonl(path, fmt="tokenized")


def test_rows_with_nothing_trainable_are_skipped_and_counted(toy_verifier_dir: Path, tmp_path: Path) -> None:
    long_prompt = {
        "messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]
    }
    path = _write(tmp_path / "d.jsonl", [{"messages": CONV}, long_prompt, {"messages": CONV}, long_prompt])
    ds = prepare_dataset(toy_verifier_dir, path, tmp_path / "out", seq_len=64)
    assert len(ds) == 2 and (ds.manifest["skipped_rows"], ds.manifest["skipped_lines"]) == (2, [2, 4])
    assert skipped_rows_note(ds.manifest) == (
        "skipped 2 row(s) with no assistant token within seq_len=64 (line 2, 4)"
    )
    only_long = _write(tmp_path / "long.jsonl", [long_prompt])
    with pytest.raises(
        DataError, match=r"no row has an assistant token .* seq_len=64 \(1 row\(s\), from line 1\)"
    ):
        prepare_dataset(toy_verifier_dir, only_long, tmp_path / "none", seq_len=64)
    assert not (tmp_path / "none").exists()  # nothing half-written
    oov = _write(tmp_path / "oov.jsonl", [{"input_ids": [1, 99999, 3], "loss_mask": [0, 1, 1]}])
    with pytest.raises(DataError, match="line 1: token id 99999 is outside"):
        prepare_dataset(toy_verifier_dir, oov, tmp_path / "out2", seq_len=64)


def test_cli_prepare_and_its_one_line_error(toy_verifier_dir: Path, tmp_path: Path) -> None:
    good = _write(tmp_path / "good.jsonl", [{"messages": CONV}] * 2)
    runner = CliRunner()
    args = ["data", "prepare", "--verifier", str(toy_verifier_dir), "--seq-len", "128"]
    result = runner.invoke(build_app(), [*args, "--data", str(good), "--out", str(tmp_path / "p")])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["num_samples"] == 2
    assert PreparedDataset.open(tmp_path / "p").manifest["draft_vocab_size"] == 512

    bad = _write(tmp_path / "bad.jsonl", [{"messages": CONV}, "{oops"])
    result = runner.invoke(build_app(), [*args, "--data", str(bad), "--out", str(tmp_path / "q")])
    assert result.exit_code != 0
    assert isinstance(result.exception, DataError) and "line 2" in str(result.exception)


def test_lines_are_read_with_a_bounded_size(toy_verifier_dir: Path, tmp_path: Path) -> None:
    import tracemalloc

    row = json.dumps({"messages": CONV})
    huge = json.dumps({"messages": [{"role": "user", "content": "x" * (20 << 20)}, CONV[2]]})
    path = tmp_path / "long.jsonl"
    path.write_text(f"{row}\n{huge}\n")
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=r"^line 2: longer than 1048576 bytes") as exc:
            validate_jsonl(path, max_line_bytes=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert exc.value.code == "line_too_long"
    assert peak < 8 << 20  # the 20 MB line was never read whole, let alone parsed
    # A line of exactly the limit is fine; the worker's reader applies the same bound.
    assert validate_jsonl(io.BytesIO(row.encode() + b"\n"), max_line_bytes=len(row)).rows == 1
    with pytest.raises(DataError, match="line 2: longer than"):
        prepare_dataset(toy_verifier_dir, path, tmp_path / "out", seq_len=64, max_line_bytes=1 << 20)


def test_deeply_nested_json_names_the_line() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(DataError, match="line 2: JSON nested too deeply"):
        validate_jsonl(io.BytesIO(json.dumps({"messages": CONV}).encode() + b"\n" + deep + b"\n"))


def test_prepared_data_key_follows_the_verifiers_content(toy_verifier_dir: Path, tmp_path: Path) -> None:
    import shutil

    from peagle_core.keys import verifier_fingerprint

    copy = tmp_path / "same-verifier-other-name"
    shutil.copytree(toy_verifier_dir, copy)
    assert verifier_fingerprint(copy) == verifier_fingerprint(toy_verifier_dir)
    # Other content (a new chat template changes every assistant mask): not the same prepared data.
    (copy / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert verifier_fingerprint(copy) != verifier_fingerprint(toy_verifier_dir)


def test_a_missing_dataset_file_is_named_the_same_way_everywhere(tmp_path: Path) -> None:
    from peagle_core.data.formats import require_dataset_file
    from peagle_core.regeneration.rewrite import RegenParams, rewrite_dataset

    missing = tmp_path / "missing.jsonl"
    assert require_dataset_file(_write(tmp_path / "ok.jsonl", [{"input_ids": [1]}])) == tmp_path / "ok.jsonl"
    with pytest.raises(
        DataError, match=r"^dataset file '.*missing\.jsonl' does not exist on the worker$"
    ) as exc:
        require_dataset_file(str(missing), param="dataset.path", where=" on the worker")
    assert (exc.value.code, exc.value.param) == ("dataset_not_found", "dataset.path")
    for call in (
        lambda: prepare_dataset("unused-verifier", missing, tmp_path / "out", 64),
        lambda: rewrite_dataset("unused-verifier", missing, tmp_path / "out.jsonl", RegenParams()),
    ):
        with pytest.raises(DataError, match="does not exist") as exc:
            call()
        assert (exc.value.code, exc.value.param) == ("dataset_not_found", "data")


def test_prepare_stops_between_rows_when_asked(toy_verifier_dir: Path, tmp_path: Path) -> None:
    path = _write(tmp_path / "d.jsonl", [{"messages": CONV}] * 10)
    asked = iter([False] * 6 + [True])
    with pytest.raises(PrepareStopped, match="stopped at line 7"):
        prepare_dataset(toy_verifier_dir, path, tmp_path / "out", seq_len=64, should_stop=lambda: next(asked))
    assert not (tmp_path / "out").exists()  # nothing half-written
