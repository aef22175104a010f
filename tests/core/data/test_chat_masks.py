"""The one-pass assistant mask equals the slow prefix-rendering reference, and costs linear time in a row's turns."""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path
from typing import Any

import pytest

from peagle_core.data.chat import encode, render_chat, tokenize_conversation
from peagle_core.data.formats import parse_row
from peagle_core.data.prepare import prepare_dataset
from peagle_core.data.tokens import PrefixTokenizer
from peagle_core.toy import build_corpus

# Templates with the toy tokenizer's special tokens, in the shapes real ones take.
CHATML = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Llama-3-like: BOS, a default system turn, trimmed contents and a blank line after each header.
LLAMA3 = (
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|system|>\n\nYou help.<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n\n{{ m['content'] | trim }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n\n{% endif %}"
)
# Qwen3-like: the last assistant turn after the last user turn gets an empty think block, so a prefix that
# ends with an assistant turn is not a prefix of the whole conversation's text.
THINK = (
    "{% set ns = namespace(last_user=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['role'] == 'assistant' and loop.last and loop.index0 > ns.last_user %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# No special token between turns: every prefix is re-tokenized whole, and words merge across turn boundaries.
PLAIN = (
    "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}{% if not loop.last %} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %} assistant:{% endif %}"
)


def reference(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """The masking as it was before it became one pass: every prefix rendered and tokenized whole."""

    def common(a: list[int], b: list[int]) -> int:
        i = 0
        while i < min(len(a), len(b)) and a[i] == b[i]:
            i += 1
        return i

    ids = encode(tokenizer, render_chat(tokenizer, messages))
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = common(
            ids, encode(tokenizer, render_chat(tokenizer, messages[:i], add_generation_prompt=True))
        )
        end = common(ids, encode(tokenizer, render_chat(tokenizer, messages[: i + 1])))
        for t in range(start, end):
            mask[t] = 1
    return ids, mask


@pytest.fixture(scope="module")
def toy_tokenizer(toy_verifier_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(toy_verifier_dir)


@pytest.fixture(scope="module")
def metaspace_tokenizer(toy_tokenizer):
    """A SentencePiece-style tokenizer (Metaspace, a prefix space on the first piece only) with the same
    special tokens and the toy template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    specials = list(toy_tokenizer.get_added_vocab())
    texts = [m["content"] for c in build_corpus(0)[:400] for m in c["messages"]]
    tok.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False)
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|end|>", pad_token="<|pad|>"
    )
    hf.chat_template = toy_tokenizer.chat_template
    return hf


def _with_template(tokenizer: Any, template: str | None) -> Any:
    if template is None:
        return tokenizer
    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other


def _rows() -> list[list[dict[str, str]]]:
    """Corpus rows, ShareGPT rows and rows with awkward edges (whitespace, empty and special-token text)."""
    rows = [c["messages"] for c in build_corpus(0)[:40] if len(c["messages"]) > 2][:12]
    rng = random.Random(5)
    corpus = [c["messages"] for c in build_corpus(0)]
    for _ in range(4):  # long ShareGPT rows: many turns drawn from the corpus, with a system prompt
        turns = [{"from": "system", "value": "Answer in one sentence."}]
        for conv in rng.sample(corpus, 8):
            turns += [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]}
                      for m in conv if m["role"] != "system"]  # fmt: skip
        rows.append(parse_row({"conversations": turns}, "sharegpt", 1).messages)
    rows += [
        [{"role": "user", "content": "  lead and trail  "}, {"role": "assistant", "content": "\n\nblank first\n"}],
        [{"role": "user", "content": "empty answer next"}, {"role": "assistant", "content": ""},
         {"role": "user", "content": "again"}, {"role": "assistant", "content": "now one"}],
        [{"role": "user", "content": "quote <|end|> and <|assistant|>"},
         {"role": "assistant", "content": "said <|end|><|user|>\nnot a turn"}],
        [{"role": "system", "content": "Sys."}, {"role": "user", "content": "ünïcödé ✓ 你好"},
         {"role": "assistant", "content": "réponse — ok"}, {"role": "user", "content": "x"},
         {"role": "assistant", "content": "y"}],
    ]  # fmt: skip
    return rows


@pytest.mark.parametrize("template", [None, CHATML, LLAMA3, THINK, PLAIN])
@pytest.mark.parametrize("which", ["toy", "metaspace"])
def test_one_pass_mask_equals_the_reference(template, which, toy_tokenizer, metaspace_tokenizer) -> None:
    tokenizer = _with_template(toy_tokenizer if which == "toy" else metaspace_tokenizer, template)
    assert PrefixTokenizer.supports(tokenizer)
    masked = 0
    for messages in _rows():
        ids, mask = reference(tokenizer, messages)
        masked += sum(mask)
        assert tokenize_conversation(tokenizer, messages) == (ids, mask), messages
        for limit in (
            1,
            7,
            len(ids) // 3,
            len(ids) - 1,
            len(ids),
            len(ids) + 5,
        ):  # cut mid-turn and at its edges
            assert tokenize_conversation(tokenizer, messages, max_tokens=limit) == (ids[:limit], mask[:limit])
    assert masked > 0


def _many_turns(pairs: int) -> dict[str, Any]:
    messages = []
    for i in range(pairs):
        messages += [{"role": "user", "content": f"What does f{i} return?"},
                     {"role": "assistant", "content": f"It returns {i} squared."}]  # fmt: skip
    return {"messages": messages}


def _prepare_seconds(verifier: Path, data: Path, out: Path) -> float:
    best = float("inf")
    for n in range(3):  # the best of three: a busy machine only ever makes a try slower
        t0 = time.perf_counter()
        prepare_dataset(verifier, data, out / str(n), seq_len=128)
        best = min(best, time.perf_counter() - t0)
    return best


def test_prepare_of_a_20k_turn_row_costs_in_proportion_to_its_size(
    toy_verifier_dir: Path, toy_tokenizer, tmp_path: Path
) -> None:
    small, big = tmp_path / "2k.jsonl", tmp_path / "20k.jsonl"
    small.write_text(json.dumps(_many_turns(1_000)) + "\n")
    big.write_text(json.dumps(_many_turns(10_000)) + "\n")
    assert big.stat().st_size > 1_000_000
    ds = prepare_dataset(toy_verifier_dir, big, tmp_path / "big", seq_len=128)
    ids, mask = reference(toy_tokenizer, _many_turns(10_000)["messages"][:40])
    assert (ds[0][0].tolist(), ds[0][1].tolist()) == (ids[:128], mask[:128])
    # 10x the turns may take 3x more than 10x the time (quadratic work would take 100x).
    assert _prepare_seconds(toy_verifier_dir, big, tmp_path) < 30 * _prepare_seconds(
        toy_verifier_dir, small, tmp_path
    )
