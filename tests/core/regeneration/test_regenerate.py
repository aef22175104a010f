"""Response regeneration: turn-by-turn rewrite, edge-case counts, cache reuse, SIGKILL + resume, engines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from peagle_core.data.chat import encode, render_chat
from peagle_core.data.formats import iter_rows
from peagle_core.regeneration.generators import TransformersGenerator
from peagle_core.regeneration.rewrite import (
    RegenParams,
    provenance_path,
    rewrite_conversations,
    rewrite_dataset,
    work_log_path,
)
from tests.fixtures.wait import wait_until

NEW_TOKENS = 12  # tiny answers keep every test here to seconds
ROWS = 12


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from peagle_core.toy import build_corpus

    # multi-turn conversations first, so the turn-by-turn history is exercised in the first batch
    convs = sorted(build_corpus(seed=0)[:60], key=lambda c: -len(c["messages"]))[:ROWS]
    path = tmp_path_factory.mktemp("regen") / "chat.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in convs))
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, toy_verifier_dir: Path, chat_data: Path) -> Path:
    """One uninterrupted transformers run: what every other run must reproduce."""
    out = tmp_path_factory.mktemp("regen_ref") / "out.jsonl"
    torch.set_num_threads(1)
    rewrite_dataset(
        str(toy_verifier_dir), chat_data, out, RegenParams(max_new_tokens=NEW_TOKENS, seq_len=128)
    )
    return out


def read_rows(path: Path) -> tuple[None, list]:
    return None, [row for _, row in iter_rows(path)]


def _greedy(verifier, messages: list[dict[str, str]], n: int) -> str:
    from peagle_core.evaluation.acceptance import greedy_decode

    tok = verifier.tokenizer
    prompt = torch.tensor(encode(tok, render_chat(tok, messages, add_generation_prompt=True)))
    ids = greedy_decode(verifier, prompt, n, tok.eos_token_id)
    ids = ids[: ids.index(tok.eos_token_id)] if tok.eos_token_id in ids else ids
    return tok.decode(ids, skip_special_tokens=True)


def test_every_assistant_turn_is_the_verifiers_answer_to_the_rewritten_history(
    reference: Path, chat_data: Path, toy_verifier
) -> None:
    _, source = read_rows(chat_data)
    _, rewritten = read_rows(reference)
    assert len(rewritten) == len(source) == ROWS
    multi_turn = 0
    for src, new in zip(source, rewritten, strict=True):
        assert [m["role"] for m in new.messages] == [m["role"] for m in src.messages]
        for i, (a, b) in enumerate(zip(src.messages, new.messages, strict=True)):
            if a["role"] != "assistant":
                assert a == b  # system and user turns stay as written
                continue
            # one-at-a-time greedy decoding of the history *as rewritten* gives the same answer
            assert b["content"] == _greedy(toy_verifier, new.messages[:i], NEW_TOKENS)
            multi_turn += i > 2
    assert multi_turn > 0
    prov = json.loads(provenance_path(reference).read_text())
    assert prov["params"]["max_new_tokens"] == NEW_TOKENS
    assert len(prov["source_sha256"]) == len(prov["verifier_fingerprint"]) == 64
    assert prov["counts"]["written"] == ROWS and prov["counts"]["turns"] > ROWS
    assert not work_log_path(reference).exists()


def test_first_turns_only_rewrites_the_first_answer_and_keeps_the_rest_as_written(
    reference: Path, chat_data: Path, toy_verifier_dir: Path, tmp_path: Path
) -> None:
    from peagle_core.keys import regenerate_key_from_params

    _, source = read_rows(chat_data)
    _, every = read_rows(reference)
    out = tmp_path / "first.jsonl"
    params = RegenParams(max_new_tokens=NEW_TOKENS, seq_len=128, turns="first")
    report = rewrite_dataset(str(toy_verifier_dir), chat_data, out, params)
    _, rows = read_rows(out)
    assert report.turns == ROWS and report.written == ROWS
    for src, all_turns, new in zip(source, every, rows, strict=True):
        first = next(i for i, m in enumerate(src.messages) if m["role"] == "assistant")
        # the first answer is the one the full rewrite gives (same history so far), the rest as written
        assert new.messages[first] == all_turns.messages[first] != src.messages[first]
        assert (
            new.messages[:first] + new.messages[first + 1 :]
            == src.messages[:first] + src.messages[first + 1 :]
        )
    # a prompts-only conversation has no written answers to keep: it ends after its first answer
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"messages": [m for m in source[0].messages if m["role"] == "user"]}) + "\n"
    )
    rewrite_dataset(str(toy_verifier_dir), prompts, tmp_path / "p.jsonl", params)
    _, (answered,) = read_rows(tmp_path / "p.jsonl")
    assert [m["role"] for m in answered.messages][-2:] == ["user", "assistant"]
    assert sum(m["role"] == "assistant" for m in answered.messages) == 1
    # its own cache key; the default's key is the one it always was (caches made before `turns` stay valid)
    everything = RegenParams(max_new_tokens=NEW_TOKENS, seq_len=128)
    legacy = {k: v for k, v in vars(everything).items() if k != "turns"}
    assert regenerate_key_from_params(everything, "s", "v") == regenerate_key_from_params(legacy, "s", "v")
    assert regenerate_key_from_params(params, "s", "v") != regenerate_key_from_params(everything, "s", "v")


def test_prompts_only_conversations_get_an_answer_after_each_user_turn(
    chat_data: Path, toy_verifier, toy_verifier_dir: Path, tmp_path: Path
) -> None:
    _, source = read_rows(chat_data)
    prompts = [
        {"messages": [m for m in row.messages if m["role"] != "assistant"], "category": f"c{i % 2}"}
        for i, row in enumerate(source[:4])
    ]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in prompts))
    out = tmp_path / "answered.jsonl"
    report = rewrite_dataset(
        str(toy_verifier_dir), data, out, RegenParams(max_new_tokens=NEW_TOKENS, seq_len=128)
    )
    assert report.written == 4
    rows = [row for _, row in iter_rows(out)]  # trainable as it is: every row now has answers
    multi_turn = 0
    for src, new in zip(prompts, rows, strict=True):
        users = [m for m in src["messages"] if m["role"] == "user"]
        assert [m for m in new.messages if m["role"] != "assistant"] == src["messages"]
        assert sum(m["role"] == "assistant" for m in new.messages) == len(users)
        assert new.category == src["category"]
        for i, m in enumerate(new.messages):
            if m["role"] == "assistant":
                assert new.messages[i - 1]["role"] == "user"  # each user turn answered, in order
                assert m["content"] == _greedy(toy_verifier, new.messages[:i], NEW_TOKENS)
                multi_turn += i > 2
    assert multi_turn > 0


def test_a_second_run_reuses_the_result(reference: Path, chat_data: Path, toy_verifier_dir: Path) -> None:
    before = reference.stat().st_mtime_ns
    report = rewrite_dataset(
        str(toy_verifier_dir), chat_data, reference, RegenParams(max_new_tokens=NEW_TOKENS, seq_len=128)
    )
    assert report.reused and report.written == ROWS
    assert reference.stat().st_mtime_ns == before


def first_prompt(tok, messages: list[dict[str, str]]) -> list[int]:
    """The tokens the verifier sees before a conversation's first answer: through its first user turn."""
    upto = 1 if messages[0]["role"] == "user" else 2
    return encode(tok, render_chat(tok, messages[:upto], add_generation_prompt=True))


def test_edge_cases_are_counted_not_raised(toy_verifier, chat_data: Path, tmp_path: Path) -> None:
    tok = toy_verifier.tokenizer
    _, rows = read_rows(chat_data)
    lengths = [len(first_prompt(tok, r.messages)) for r in rows]
    # a seq_len between the prompt lengths: the longer first prompts are skipped, the rest rewritten
    seq_len = sorted(lengths)[len(lengths) // 2]
    params = RegenParams(max_new_tokens=2, seq_len=seq_len)
    stops = [tok.eos_token_id]
    gen = TransformersGenerator(toy_verifier.model, tok, stops, temperature=0.0, seed=0)
    convs, _ = rewrite_conversations(list(enumerate(rows)), tok, gen, params)
    too_long = sum(c.counts.get("skipped_prompt_too_long", 0) for c in convs)
    hit_max = sum(c.counts.get("hit_max_new_tokens", 0) for c in convs)
    assert too_long >= sum(n >= seq_len for n in lengths) > 0
    assert hit_max == sum(c.counts.get("turns", 0) for c in convs) > 0  # 2 tokens never reach the end of turn
    # an answer that is empty: stop at the very token the verifier emits first
    # (the prompt the rewrite sends: with a system message it is system + user, not the system message alone)
    first = gen.generate([first_prompt(tok, rows[0].messages)], 1)[0]
    empty_gen = TransformersGenerator(toy_verifier.model, tok, [first.tokens[0]], temperature=0.0, seed=0)
    convs, _ = rewrite_conversations(
        [(0, rows[0])], tok, empty_gen, RegenParams(max_new_tokens=4, seq_len=128)
    )
    assert convs[0].counts["dropped_empty"] == 1 and convs[0].counts.get("turns", 0) == 0
    assert not any(m["role"] == "assistant" for m in convs[0].out)


def test_the_summary_counts_skipped_conversations(
    toy_verifier_dir: Path, chat_data: Path, tmp_path: Path
) -> None:
    out = tmp_path / "short.jsonl"
    report = rewrite_dataset(str(toy_verifier_dir), chat_data, out, RegenParams(max_new_tokens=2, seq_len=24))
    assert report.skipped_prompt_too_long > 0 and report.hit_max_new_tokens == report.turns > 0
    assert report.written + report.dropped_conversations == ROWS
    assert len(out.read_text().splitlines()) == report.written
    flagged = json.loads(provenance_path(out).read_text())["hit_max_new_tokens_turns"]
    assert len(flagged) == report.hit_max_new_tokens


def test_sigkill_then_resume_loses_and_duplicates_nothing(
    toy_verifier_dir: Path, chat_data: Path, reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "peagle_core", "data", "regenerate", "--verifier", str(toy_verifier_dir),
           "--data", str(chat_data), "--out", str(out), "--max-new-tokens", str(NEW_TOKENS), "--seq-len", "128",
           "--batch-size", "2"]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    log = work_log_path(out)

    def some_appended() -> bool:  # kill once some conversations are appended and more are still to come
        assert proc.poll() is None, "the run finished before it could be killed"
        return log.is_file() and len(log.read_bytes().splitlines()) >= 3

    wait_until(some_appended, message="three conversations appended", timeout=300)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(log.read_bytes().splitlines()) - 1
    assert 2 <= done < ROWS and not out.exists()

    resumed = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads(resumed.stdout.splitlines()[-1])
    assert report["resumed_from"] >= done and report["conversations"] == ROWS
    assert out.read_text() == reference.read_text()  # same rows, once each, in source order


def test_vllm_and_transformers_write_the_same_text_at_temperature_0(
    vllm_engine, toy_verifier_dir: Path, chat_data: Path, reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / "vllm.jsonl"
    # fp32 in both engines: equal text needs equal numerics (vLLM's `auto` is bf16 where bf16 is fast)
    params = RegenParams(max_new_tokens=NEW_TOKENS, seq_len=128, engine="vllm", dtype="float32")
    report = rewrite_dataset(str(toy_verifier_dir), chat_data, out, params, vllm_engine=vllm_engine)
    assert report.turns > 0 and report.generated_tokens > 0
    assert out.read_text() == reference.read_text()


def test_vllm_regeneration_keeps_one_engine_for_batches_of_any_length(
    vllm_engine, toy_verifier_dir: Path
) -> None:
    from peagle_core.regeneration.generators import VllmGenerator

    gen = VllmGenerator(vllm_engine, str(toy_verifier_dir), [], temperature=0.0, seed=0, seq_len=512,
                        dtype="float32")  # fmt: skip
    gen.generate([[5, 6, 7]], 4)
    built = gen.engine_builds
    # sized by each batch's longest prompt, these engines would differ (256 and 512 tokens)
    gen.generate([[5, 6, 7] * 100], 4)
    gen.generate([[5]], 4)
    assert gen.engine_builds == built >= 1


def test_peagle_train_regenerates_before_preparing(
    toy_verifier_dir: Path, chat_data: Path, tmp_path: Path
) -> None:
    from peagle_core.data import PreparedDataset
    from peagle_core.events import CallbackReporter
    from peagle_core.io import sha256_file
    from peagle_core.keys import regenerate_key, verifier_fingerprint
    from peagle_core.pipeline.stages import Callbacks, Pipeline
    from peagle_core.spec import parse_spec

    spec = parse_spec(
        {
            "verifier": {"name_or_path": str(toy_verifier_dir)},
            "dataset": {
                "path": str(chat_data),
                "seq_len": 128,
                "max_samples": 4,
                "regenerate": {"max_new_tokens": 4},
            },
            "training": {"total_seq_len": 256},
        }
    )
    events: list[tuple[str, dict]] = []

    def data_dir() -> Path:
        # `peagle train`'s data stages: a local store in the output directory.
        stages = Pipeline.of(
            spec,
            tmp_path,
            callbacks=Callbacks(reporter=CallbackReporter(events=lambda e: events.append((e.kind, e.data)))),
        )
        path = stages.data()
        assert path is not None
        return path

    dataset = PreparedDataset.open(data_dir())
    key = regenerate_key(spec, sha256_file(chat_data), verifier_fingerprint(toy_verifier_dir))
    regenerated = tmp_path / "regenerated" / key / "data.jsonl"
    assert dataset.manifest["source_path"] == str(regenerated) and len(dataset) == 4
    prov = json.loads(provenance_path(regenerated).read_text())
    assert prov["params"]["max_new_tokens"] == 4 and prov["fingerprint"] == key
    assert [k for k, _ in events if k in ("regenerate", "prepare")] == ["regenerate", "prepare"]

    # A second run (`peagle train` resumed) reuses both stages' outputs.
    events.clear()
    assert data_dir() == dataset.path
    reused = {d["kind"] for k, d in events if k == "log" and d.get("reused")}
    assert reused == {"regenerate", "prepare"} and "regenerate" not in [k for k, _ in events]


def test_the_spec_field_accepts_true_false_or_settings_and_names_bad_ones() -> None:
    from peagle_core.spec import SpecError, parse_spec

    base = {"verifier": {"name_or_path": "v"}, "dataset": {"path": "d.jsonl"}}
    assert parse_spec(base).model_dump()["dataset"]["regenerate"] is False
    on = parse_spec({**base, "dataset": {"path": "d.jsonl", "regenerate": True}})
    assert on.dataset.regenerate.max_new_tokens == 512 and on.dataset.regenerate.engine == "transformers"
    assert parse_spec(on.model_dump()).dataset.regenerate == on.dataset.regenerate
    for bad, param in (
        ({"engine": "sglang"}, "dataset.regenerate.engine"),
        ({"max_new_tokens": 0}, "dataset.regenerate.max_new_tokens"),
        ({"temperature": -1}, "dataset.regenerate.temperature"),
    ):
        with pytest.raises(SpecError) as err:
            parse_spec({**base, "dataset": {"path": "d.jsonl", "regenerate": bad}})
        assert err.value.param == param
    with pytest.raises(SpecError, match="regenerate needs chat data"):
        parse_spec({**base, "dataset": {"path": "d.jsonl", "format": "tokenized", "regenerate": True}})
