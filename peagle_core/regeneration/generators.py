"""Text generators for regeneration: the verifier's answers turn by turn, with transformers' `generate`
or vLLM's offline batching, both ending a turn at the model's own stop tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from peagle_core.errors import VerifierError

if TYPE_CHECKING:
    from peagle_core.vllm_engine import VllmProcess

Engine = Literal["transformers", "vllm"]


@dataclass
class Generation:
    """One generated turn: its tokens without the stop token, and whether a stop token ended it."""

    tokens: list[int]
    finished: bool


class Generator(Protocol):
    def generate(self, prompts: Sequence[list[int]], max_new_tokens: int) -> list[Generation]: ...


def stop_token_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """End-of-turn tokens: the tokenizer's EOS and whatever the model's generation config lists."""
    ids: list[int] = []
    for source in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        for i in source if isinstance(source, list | tuple) else [source]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    if not ids:
        raise VerifierError("the verifier's tokenizer has no end-of-sequence token to stop a turn at")
    return ids


def _cut(tokens: Sequence[int], stops: set[int], max_new_tokens: int) -> Generation:
    for i, t in enumerate(tokens):
        if t in stops:
            return Generation(list(tokens[:i]), True)
    # vLLM stops at the model's own EOS too; a stop it reports without the token still ends the turn
    return Generation(list(tokens), len(tokens) < max_new_tokens)


class TransformersGenerator:
    """Batched `model.generate` with a KV cache, prompts sorted by length and left-padded per batch."""

    def __init__(self, model: Any, tokenizer: Any, stops: list[int], *, temperature: float, seed: int,
                 batch_size: int = 16):  # fmt: skip
        self.model, self.tokenizer, self.stops = model, tokenizer, stops
        self.temperature, self.seed, self.batch_size = temperature, seed, batch_size
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]

    def generate(self, prompts: Sequence[list[int]], max_new_tokens: int) -> list[Generation]:
        import torch

        out: list[Generation | None] = [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        device = next(self.model.parameters()).device
        sampling = (
            {"do_sample": True, "temperature": self.temperature, "top_k": 0, "top_p": 1.0}
            if self.temperature > 0
            else {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
        )
        for s in range(0, len(order), self.batch_size):
            chunk = order[s : s + self.batch_size]
            width = max(len(prompts[i]) for i in chunk)
            ids = torch.full((len(chunk), width), self.pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, i in enumerate(chunk):
                p = prompts[i]
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            if self.temperature > 0:
                torch.manual_seed(self.seed + s)
            with torch.inference_mode():
                gen = self.model.generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    max_new_tokens=max_new_tokens,
                    eos_token_id=self.stops,
                    pad_token_id=self.pad,
                    use_cache=True,
                    **sampling,
                )
            for row, i in enumerate(chunk):
                out[i] = _cut(gen[row, width:].tolist(), set(self.stops), max_new_tokens)
        return [g for g in out if g is not None]


class VllmGenerator:
    """vLLM's offline batched generation in its child process (`peagle_core.vllm_engine`)."""

    def __init__(self, engine: VllmProcess, verifier: str, stops: list[int], *, temperature: float,
                 seed: int, seq_len: int, trust_remote_code: bool = False, dtype: str = "float32"):  # fmt: skip
        self.engine, self.verifier, self.stops = engine, verifier, stops
        self.temperature, self.seed, self.seq_len = temperature, seed, seq_len
        self.trust_remote_code, self.dtype = trust_remote_code, dtype
        self.engine_builds = 0  # the child's count after the last batch

    def generate(self, prompts: Sequence[list[int]], max_new_tokens: int) -> list[Generation]:
        from peagle_core.vllm_engine import model_len_within

        run = self.engine.sample(
            self.verifier,
            [list(p) for p in prompts],
            max_new_tokens,
            temperature=self.temperature,
            stop_token_ids=self.stops,
            seed=self.seed,
            dtype=self.dtype,
            # Every prompt is shorter than seq_len (longer ones are cut before): one engine for all batches.
            max_model_len=model_len_within(self.seq_len, max_new_tokens),
            trust_remote_code=self.trust_remote_code,
        )
        self.engine_builds = run.engine_builds
        stops = set(self.stops)
        out = []
        for tokens, reason in zip(run.tokens, run.finish_reasons, strict=True):
            g = _cut(tokens, stops, max_new_tokens)
            out.append(Generation(g.tokens, g.finished or reason == "stop"))
        return out


def open_generator(
    engine: Engine,
    verifier: str,
    *,
    temperature: float,
    seed: int,
    seq_len: int,
    batch_size: int,
    revision: str | None = None,
    trust_remote_code: bool = False,
    vllm_engine: VllmProcess | None = None,
    dtype: str = "auto",
) -> tuple[Any, Generator, Callable[[], None]]:
    """(tokenizer, generator, close) for `engine`; a vLLM engine is started unless `vllm_engine` is given
    (then `close` leaves it running). `dtype` is the verifier's (`verifier.dtype`): vLLM resolves `auto`
    by `peagle_core.model.precision.vllm_dtype`, transformers as `Verifier.load` does."""
    if engine == "vllm":
        import torch
        from transformers import AutoTokenizer, GenerationConfig

        from peagle_core.model.precision import vllm_dtype
        from peagle_core.vllm_engine import VllmProcess

        cuda = torch.cuda.is_available()  # where vLLM's child runs the verifier
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                verifier, revision=revision, trust_remote_code=trust_remote_code
            )
            gen_config = GenerationConfig.from_pretrained(verifier, revision=revision)
        except (OSError, ValueError) as exc:
            raise VerifierError(
                f"cannot load verifier {verifier!r}: {exc}", param="verifier.name_or_path"
            ) from exc
        running = vllm_engine or VllmProcess().start()
        close = (lambda: None) if vllm_engine is not None else running.close
        stops = stop_token_ids(tokenizer, gen_config)
        gen = VllmGenerator(
            running, verifier, stops, temperature=temperature, seed=seed, seq_len=seq_len,
            trust_remote_code=trust_remote_code, dtype=vllm_dtype(dtype, "cuda" if cuda else "cpu"),
        )  # fmt: skip
        return tokenizer, gen, close
    from peagle_core.hidden_states.verifier import Verifier

    v = Verifier.load(verifier, revision=revision, trust_remote_code=trust_remote_code, dtype=dtype)
    stops = stop_token_ids(v.tokenizer, getattr(v.model, "generation_config", None))
    gen = TransformersGenerator(
        v.model, v.tokenizer, stops, temperature=temperature, seed=seed, batch_size=batch_size
    )
    return v.tokenizer, gen, lambda: None
