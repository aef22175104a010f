"""The verifier runner: loads any HF causal LM and returns the hidden states and logits the drafter learns from.

`aux` is the concatenation of three decoder-layer inputs (HF `hidden_states[i]`, the layers vLLM captures);
`last` is the last decoder layer's output *before* the final norm, taken with a pre-hook on that norm
because HF's `hidden_states[-1]` is already normed in some versions.
"""

from __future__ import annotations

import threading
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peagle_core.errors import VerifierError
from peagle_core.keys import verifier_fingerprint
from peagle_core.model.config import ascending_layer_ids, default_layer_ids

if TYPE_CHECKING:
    import torch

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
_DTYPES["float16"] = _DTYPES["fp16"] = "float16"


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or Path(name).expanduser().exists() or name.count("/") > 1


def _find_attr(module: Any, names: tuple[str, ...], what: str) -> Any:
    for name in names:
        found = getattr(module, name, None)
        if found is not None:
            return found
    raise VerifierError(f"cannot find the verifier's {what} (looked for {', '.join(names)})")


def _aux_layer_ids(layer_ids: list[int] | None, num_layers: int) -> list[int]:
    """The layers to capture, ascending: EAGLE-3's defaults, or the given three (in range) sorted."""
    if layer_ids is None:
        try:
            return default_layer_ids(num_layers)
        except ValueError as exc:
            raise VerifierError(str(exc), code="verifier_unsupported") from exc
    try:
        ids = ascending_layer_ids(list(layer_ids))
    except ValueError as exc:
        ids, reason = list(layer_ids), str(exc)
    else:
        reason = f"must be 3 ids in [0, {num_layers - 1}]" if ids[-1] >= num_layers else None
    if reason is not None:
        raise VerifierError(
            f"layer_ids {ids}: {reason}", code="verifier_unsupported", param="verifier.layer_ids"
        )
    return ids


class Verifier:
    """A loaded verifier model (eval mode, no grad) plus its tokenizer; see docs/interfaces.md."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        name_or_path: str,
        layer_ids: list[int] | None = None,
        revision: str | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.name_or_path = name_or_path
        self.revision = revision
        self.config = model.config
        text_config = self.config.get_text_config()
        self.hidden_size: int = text_config.hidden_size
        self.vocab_size: int = text_config.vocab_size
        self.num_layers: int = text_config.num_hidden_layers
        self.layer_ids = _aux_layer_ids(layer_ids, self.num_layers)
        self.calls = 0
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.final_norm = _find_attr(decoder, ("norm", "final_layernorm", "ln_f"), "final norm")
        # Per thread: the trainer's batch loader runs the verifier in its own thread while the main thread
        # evaluates with it, and each forward must read back its own final-norm input.
        self._captured = threading.local()
        self.final_norm.register_forward_pre_hook(self._capture_norm_input)

    # ------------------------------------------------------------ loading

    @classmethod
    def load(
        cls,
        name_or_path: str,
        revision: str | None = None,
        dtype: str = "auto",
        device: str | None = None,
        layer_ids: list[int] | None = None,
        trust_remote_code: bool = False,
    ) -> Verifier:
        """Load by local path or hub id through the same `from_pretrained` call.

        Raises VerifierError `verifier_not_found` (no such path or repo) or `verifier_unavailable`
        (anything else, e.g. no network for a hub id or an unsupported architecture).
        """
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        if _looks_like_path(name_or_path) and not Path(name_or_path).expanduser().is_dir():
            raise VerifierError(
                f"verifier path {name_or_path!r} does not exist",
                code="verifier_not_found",
                param="verifier.name_or_path",
            )
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if dtype == "auto":
            torch_dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
        elif dtype in _DTYPES:
            torch_dtype = getattr(torch, _DTYPES[dtype])
        else:
            raise VerifierError(f"unknown verifier dtype {dtype!r}", param="verifier.dtype")
        path = str(Path(name_or_path).expanduser()) if _looks_like_path(name_or_path) else name_or_path
        try:
            # the config first: a small file, so an unreachable hub fails once instead of per file
            config = AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
            tokenizer = AutoTokenizer.from_pretrained(
                path, revision=revision, trust_remote_code=trust_remote_code
            )
            model = AutoModelForCausalLM.from_pretrained(
                path, config=config, revision=revision, trust_remote_code=trust_remote_code, dtype=torch_dtype
            )
        except (OSError, ValueError, KeyError, ImportError) as exc:
            text = str(exc)
            not_found = any(
                s in text
                for s in ("is not a local folder", "not a valid model identifier", "Repository Not Found")
            )
            raise VerifierError(
                f"cannot load verifier {name_or_path!r}: {text.splitlines()[0] if text else type(exc).__name__}",
                code="verifier_not_found" if not_found else "verifier_unavailable",
                param="verifier.name_or_path",
            ) from exc
        model.to(device).eval().requires_grad_(False)
        return cls(model, tokenizer, name_or_path, layer_ids, revision)

    # ------------------------------------------------------------ properties

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The output projection `[V, H]` (shared with the embedding when tied)."""
        return self.model.get_output_embeddings().weight

    @property
    def embed_weight(self) -> torch.Tensor:
        """The input embedding `[V, H]`, used to initialise the drafter's embeddings."""
        return self.model.get_input_embeddings().weight

    @cached_property
    def fingerprint(self) -> str:
        """The verifier's content fingerprint (`peagle_core.keys.verifier_fingerprint`)."""
        return verifier_fingerprint(self.name_or_path, self.revision)

    # ------------------------------------------------------------ forward passes

    def _capture_norm_input(self, _module: Any, args: tuple[Any, ...]) -> None:
        self._captured.last = args[0]

    def _forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        want_logits: bool,
        cached: dict[str, Any] | None = None,
    ):
        import torch

        input_ids = input_ids.to(self.device)
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
        # no cache unless the caller holds one: a full pass would otherwise build (and drop) one per call
        kwargs = cached if cached is not None else {"use_cache": False}
        self.calls += 1
        self._captured.last = None
        with torch.inference_mode():
            if want_logits:
                out = self.model(
                    input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, **kwargs
                )
                logits = out.logits
            else:
                # the base model alone: skips the lm_head, which is the largest matmul for big vocabularies
                decoder = self.model.get_decoder()
                out = decoder(
                    input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, **kwargs
                )
                logits = None
            aux = torch.cat([out.hidden_states[i] for i in self.layer_ids], dim=-1)
            last = self._captured.last
            self._captured.last = None
        if last is None:
            raise VerifierError("the verifier's final norm was not called; unsupported architecture")
        return logits, aux, last

    def hidden_states(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(aux [B,T,3H], last [B,T,H])` for a batch; `last` is the final norm's input."""
        _, aux, last = self._forward(input_ids, attention_mask, want_logits=False)
        return aux, last

    def logits(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(logits [B,T,V], aux [B,T,3H])` for a batch, for evaluation."""
        logits, aux, _ = self._forward(input_ids, attention_mask, want_logits=True)
        return logits, aux

    def extend(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any,
        logits_to_keep: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(logits, aux [B,T,3H])` of `input_ids [B,T]` appended to a KV `cache` (a transformers
        `DynamicCache`, updated in place). `attention_mask [B, cached + T]` marks the valid cache entries
        and new tokens, `position_ids [B,T]` each row's positions; `logits_to_keep=n` keeps the last n."""
        kwargs = {"position_ids": position_ids.to(self.device), "past_key_values": cache, "use_cache": True}
        if logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        logits, aux, _ = self._forward(input_ids, attention_mask, want_logits=True, cached=kwargs)
        return logits, aux
