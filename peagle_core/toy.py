"""A tiny, real verifier and chat corpus built offline: stdlib docstrings, a BPE tokenizer, a small Llama.

Tests and the demo need a verifier that `AutoModelForCausalLM.from_pretrained` loads without a model hub;
this module builds one deterministically per (size, seed) and caches it.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import inspect
import json
import math
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from peagle_core.io import atomic_dir, atomic_write_bytes

TOY_BUILD_VERSION = 1  # bump when the corpus, tokenizer or training recipe changes: invalidates caches

# The corpus is built from PINNED_DOCS, not from the running interpreter: docstrings change between Python
# patch releases (3.11.2 and 3.11.7 differ in five), and with them the toy verifier, its datasets and every
# figure measured on them. `stdlib_docs` is the recipe that wrote the file (`pin_docs` rewrites it).
PINNED_DOCS = Path(__file__).with_name("toy_docs.json")
# The modules the docstrings come from: a fixed list, so the recipe is the same on every machine.
CORPUS_MODULES = (
    "abc", "argparse", "array", "base64", "binascii", "bisect", "bz2", "calendar", "cmath", "codecs",
    "collections", "colorsys", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "email.utils", "enum", "filecmp", "fnmatch", "fractions", "functools",
    "gettext", "glob", "graphlib", "gzip", "hashlib", "heapq", "hmac", "html", "http.client", "inspect",
    "io", "ipaddress", "itertools", "json", "keyword", "linecache", "locale", "logging", "lzma", "math",
    "mimetypes", "numbers", "operator", "os", "os.path", "pathlib", "pickle", "platform", "pprint",
    "queue", "random", "re", "reprlib", "sched", "secrets", "shlex", "shutil", "signal", "socket",
    "sqlite3", "stat", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "time", "timeit", "tokenize", "tomllib", "traceback", "types", "typing",
    "unicodedata", "urllib.parse", "uuid", "warnings", "weakref", "zipfile", "zlib",
)  # fmt: skip

QUESTIONS = (
    "What does {name} do?",
    "Explain {name}.",
    "What is {name} for?",
    "Describe {name} briefly.",
)
FOLLOW_UPS = ("And {name}?", "What about {name}?", "How about {name}?")
SYSTEM_PROMPT = "You are a helpful assistant for the Python standard library."
# Names that other libraries replace on import (torch swaps in its own `inspect.getfile`): left in, the
# corpus and so the verifier's cache key would depend on what the process imported first.
UNSTABLE_NAMES = frozenset({"inspect.getfile"})

BOS, EOS, PAD, MASK = "<|bos|>", "<|end|>", "<|pad|>", "<|mask|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, MASK, *ROLE_TOKENS)

# Each turn is `<|role|>\n content <|end|>` with nothing after `<|end|>`, so an assistant turn's loss
# (found by prefix rendering) covers exactly its content and the `<|end|>` it must emit.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class ToySize:
    """Model shape and training budget of one toy size."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    max_conversations: int | None  # the test size trains on a slice of the corpus
    threads: int | None  # torch CPU threads while training; None keeps torch's default


SIZES: dict[str, ToySize] = {
    # One thread for the test size: its matmuls are too small to gain from more, the result is then
    # bit-identical on any machine, and a busy CI box cannot stall it in thread contention.
    # head_dim 32: vLLM's CPU attention rejects 16, and the serving tests load this size in vLLM. 240
    # steps: at 60 the verifier's greedy answers degenerate into one repeated token.
    "test": ToySize(512, 64, 4, 2, 1, 128, 128, 8, 240, 3e-3, 600, 1),
    "default": ToySize(4096, 256, 4, 4, 4, 512, 256, 8, 120, 2e-3, None, None),
}


# ---------------------------------------------------------------- corpus


def _first_paragraph(doc: str, max_words: int = 60) -> str | None:
    """The docstring's first prose paragraph, whitespace-normalised and cut at a sentence near max_words."""
    for para in doc.split("\n\n"):
        text = " ".join(para.split())
        # builtins often open with a call signature; skip it
        if not text or re.fullmatch(r"[\w.]+\(.*\)( -> .*)?", text):
            continue
        words = text.split(" ")
        if len(words) > max_words:
            text = " ".join(words[:max_words])
            cut = text.rfind(". ")
            text = text[: cut + 1] if cut > 40 else text + " ..."
        return text if len(text) >= 12 else None
    return None


def stdlib_docs() -> list[tuple[str, str]]:
    """(qualified name, first docstring paragraph) for the public functions and classes of CORPUS_MODULES."""
    docs: dict[str, str] = {}
    for mod_name in CORPUS_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:  # e.g. a Python built without sqlite3
            continue
        real_name = mod.__name__
        for attr in sorted(dir(mod)):
            if attr.startswith("_") or f"{mod_name}.{attr}" in UNSTABLE_NAMES:
                continue
            obj = getattr(mod, attr, None)
            if not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
                continue
            # only objects defined here, and only their own docstring (not one inherited from a base)
            if getattr(obj, "__module__", None) not in (real_name, mod_name):
                continue
            doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
            if not isinstance(doc, str):
                continue
            text = _first_paragraph(inspect.cleandoc(doc))
            if text:
                docs[f"{mod_name}.{attr}"] = text
    return sorted(docs.items())


def pinned_docs() -> list[tuple[str, str]]:
    """The corpus's (qualified name, docstring paragraph) pairs, as pinned (PINNED_DOCS)."""
    return [(name, text) for name, text in json.loads(PINNED_DOCS.read_text())]


def pin_docs(path: Path = PINNED_DOCS) -> None:
    """Rewrite the pinned docstrings from this interpreter's stdlib (one pair a line, for reviewable diffs).
    This changes the toy verifier: bump TOY_BUILD_VERSION with it."""
    lines = ",\n".join(json.dumps(list(pair), ensure_ascii=False) for pair in stdlib_docs())
    path.write_text(f"[\n{lines}\n]\n")


def build_corpus(seed: int = 0) -> list[dict[str, Any]]:
    """Deterministic chat conversations (messages format) from the pinned stdlib docstrings.

    Every documented name gets a single-turn Q&A; names of the same module are also chained into
    two- and three-turn conversations, some with a system prompt.
    """
    rng = random.Random(seed)
    docs = pinned_docs()
    convs: list[dict[str, Any]] = []
    for name, text in docs:
        q = rng.choice(QUESTIONS).format(name=name)
        convs.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": text}]})
    by_module: dict[str, list[tuple[str, str]]] = {}
    for name, text in docs:
        by_module.setdefault(name.rsplit(".", 1)[0], []).append((name, text))
    for _mod, items in sorted(by_module.items()):
        items = list(items)
        rng.shuffle(items)
        i = 0
        while i + 1 < len(items):
            turns = 2 if rng.random() < 0.7 or i + 2 >= len(items) else 3
            msgs: list[dict[str, str]] = []
            if rng.random() < 0.3:
                msgs.append({"role": "system", "content": SYSTEM_PROMPT})
            for j, (name, text) in enumerate(items[i : i + turns]):
                q = (rng.choice(QUESTIONS) if j == 0 else rng.choice(FOLLOW_UPS)).format(name=name)
                msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": text}]
            convs.append({"messages": msgs})
            i += turns
    rng.shuffle(convs)
    return convs


def write_toy_dataset(out: str | Path, n: int | None = None, seed: int = 0) -> Path:
    """Write `n` corpus conversations (all when None) as messages-format JSONL, atomically."""
    convs = build_corpus(seed)
    if n is not None:
        if n < 1:
            raise ValueError("n must be >= 1")
        convs = (convs * (n // len(convs) + 1))[:n]
    data = "".join(json.dumps(c, ensure_ascii=False, sort_keys=True) + "\n" for c in convs)
    atomic_write_bytes(out, data.encode())
    return Path(out)


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer over `texts` with the chat special tokens, as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        mask_token=MASK,
        additional_special_tokens=list(ROLE_TOKENS),
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


# ---------------------------------------------------------------- model


def _cache_root(cache_dir: str | Path | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    from peagle_core.catalogue import cache_root

    return cache_root() / "toy"


def _cache_key(size: str, seed: int, corpus: list[dict[str, Any]]) -> str:
    h = hashlib.sha256(json.dumps(corpus, sort_keys=True).encode())
    h.update(f"{TOY_BUILD_VERSION}|{size}|{seed}|{asdict(SIZES[size])}|{CHAT_TEMPLATE}".encode())
    return f"{size}-seed{seed}-{h.hexdigest()[:12]}"


def _token_stream(tokenizer, convs: list[dict[str, Any]]) -> list[int]:
    ids: list[int] = []
    for c in convs:
        text = tokenizer.apply_chat_template(c["messages"], tokenize=False)
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


def _train_model(size: ToySize, tokenizer, train_ids: list[int], val_ids: list[int], seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_kv_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    final_loss = _fit(model, size, train_ids, seed)
    metrics = _heldout_metrics(model, val_ids, size.seq_len)
    metrics["chance_accuracy"] = 1.0 / config.vocab_size
    metrics["final_train_loss"] = final_loss
    return model, metrics


def _fit(model, size: ToySize, train_ids: list[int], seed: int) -> float:
    """Train on random `size.seq_len` windows of `train_ids` (warmup, then cosine decay to a tenth of the
    peak); returns the last step's loss. Part of the recipe: a change here wants a TOY_BUILD_VERSION bump."""
    import torch

    model.train()
    T = size.seq_len
    data = torch.tensor(train_ids, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=size.lr, weight_decay=0.0, betas=(0.9, 0.95))
    warmup = max(1, size.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return size.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, size.steps - warmup)
        return size.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    for step in range(size.steps):
        starts = torch.randint(0, len(data) - T - 1, (size.batch_size,), generator=gen)
        x = torch.stack([data[s : s + T] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return float(loss.item())


def _heldout_metrics(model, val_ids: list[int], T: int) -> dict[str, float]:
    """Next-token accuracy and perplexity on up to 32 windows of `val_ids`."""
    import torch

    model.eval()
    val = torch.tensor(val_ids, dtype=torch.long)
    n_chunks = max(1, min(32, (len(val) - 1) // T))
    correct = total = 0
    nll = 0.0
    with torch.inference_mode():
        for i in range(n_chunks):
            x = val[i * T : (i + 1) * T + 1]
            if len(x) < 2:
                break
            logits = model(input_ids=x[None, :-1]).logits[0]
            target = x[1:]
            nll += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
            correct += (logits.argmax(-1) == target).sum().item()
            total += len(target)
    return {
        "heldout_tokens": total,
        "heldout_next_token_accuracy": correct / max(total, 1),
        "heldout_perplexity": math.exp(nll / max(total, 1)),
    }


def build_toy_verifier(
    size: str = "default",
    seed: int = 0,
    out: str | Path | None = None,
    cache_dir: str | Path | None = None,
) -> Path:
    """Build (or reuse from the cache) the toy verifier and return its HF model directory.

    The directory holds the model, the tokenizer (with chat template and `<|mask|>`) and
    `toy_verifier.json` (size, seed, `mask_token_id`, held-out accuracy/perplexity). With `out`,
    a copy is placed there (atomically) and `out` is returned.
    """
    if size not in SIZES:
        raise ValueError(f"unknown toy size {size!r}; choose one of {sorted(SIZES)}")
    spec = SIZES[size]
    corpus = build_corpus(seed)
    cached = _cache_root(cache_dir) / _cache_key(size, seed, corpus)
    if not (cached / "toy_verifier.json").is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        # one builder per key: concurrent test sessions wait for the first build instead of racing it
        with open(cached.with_name(cached.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (cached / "toy_verifier.json").is_file():
                _build_into(cached, spec, size, seed, corpus)
    if out is None:
        return cached
    with atomic_dir(out) as tmp:
        for f in cached.iterdir():
            shutil.copy2(f, tmp / f.name)
    return Path(out)


def _build_into(target: Path, spec: ToySize, size: str, seed: int, corpus: list[dict[str, Any]]) -> None:
    import torch

    t0 = time.monotonic()
    convs = corpus if spec.max_conversations is None else corpus[: spec.max_conversations]
    n_val = max(4, len(convs) // 20)
    val_convs, train_convs = convs[:n_val], convs[n_val:]
    texts = [m["content"] for c in train_convs for m in c["messages"]]
    tokenizer = train_tokenizer(texts, spec.vocab_size)
    train_ids = _token_stream(tokenizer, train_convs)
    val_ids = _token_stream(tokenizer, val_convs)
    threads = torch.get_num_threads()
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    try:
        model, metrics = _train_model(spec, tokenizer, train_ids, val_ids, seed)
        used_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    info = {
        "build_version": TOY_BUILD_VERSION,
        "size": size,
        "seed": seed,
        "shape": asdict(spec),
        "mask_token": MASK,
        "mask_token_id": tokenizer.convert_tokens_to_ids(MASK),
        "corpus_conversations": len(convs),
        "train_tokens": len(train_ids),
        "build_seconds": round(time.monotonic() - t0, 2),
        "torch_threads": used_threads,
        **metrics,
    }
    with atomic_dir(target) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "toy_verifier.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
