"""The job spec: the one pydantic definition of a training job, shared by the API, the worker and the CLI.

A YAML or JSON file maps 1:1 onto `JobSpec`; every field is validated with a message that names it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

from peagle_core.documents import DocumentError, load_json_document, load_yaml, number_problem
from peagle_core.errors import PeagleError
from peagle_core.model.config import DEFAULT_DRAFT_VOCAB_SIZE, DrafterSettings, ascending_layer_ids
from peagle_core.text import text_problem

_QUEUE_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
# Upper bounds on what a client may ask for: far above any real job, low enough that a hostile or mistyped
# spec cannot make the worker allocate, loop or store without limit.
MAX_STEPS = 100_000_000
MAX_LAYER_ID = 1023
MAX_SAMPLES = 1_000_000_000
MAX_CACHE_BYTES = 1 << 50  # 1 PiB
MAX_PROMPTS = 1000
MAX_PROMPT_CHARS = 32768
MAX_CATEGORY_CHARS = 64
MAX_SEED = (1 << 63) - 1  # seeds travel as signed 64-bit integers (torch, numpy, Postgres BIGINT)
MAX_NODES = 16


class _Strict(BaseModel):
    # Unknown keys are errors: a typo in a spec must never be silently ignored. NaN and infinities are
    # refused in every float field (`grad_clip: .inf` is a typo for "no clipping", which is `null`).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
    # Fields holding text a model reads (prompts): tabs and newlines allowed. Every other string is a name.
    free_text_fields: ClassVar[frozenset[str]] = frozenset()

    @field_validator("*", mode="after")
    @classmethod
    def _storable_text(cls, v: Any, info: ValidationInfo) -> Any:
        # One rule for every string of every spec model (peagle_core.text): what Postgres, a JSON answer
        # or a tokenizer cannot hold is refused here, naming the field, instead of failing where stored.
        problem = _text_problem_in(v, free_text=info.field_name in cls.free_text_fields)
        if problem is not None:
            raise ValueError(problem)
        return v


def _text_problem_in(value: Any, *, free_text: bool) -> str | None:
    """The first text problem in a field's value: a string, or the strings of a list (nested models check
    their own fields)."""
    if isinstance(value, str):
        return text_problem(value, free_text=free_text)
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            if (problem := _text_problem_in(item, free_text=free_text)) is not None:
                return f"item {i}: {problem}"
    return None


class VerifierSpec(_Strict):
    """The verifier: a Hugging Face causal LM, by local path or hub id."""

    name_or_path: Annotated[str, Field(min_length=1, max_length=1024)]
    revision: str | None = Field(default=None, max_length=256)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    layer_ids: list[Annotated[int, Field(ge=0, le=MAX_LAYER_ID)]] | None = Field(
        default=None,
        description="Three verifier layers whose hidden states feed the drafter, sorted ascending (the order "
        "vLLM gathers them in); default [2, L//2, L-3].",
    )
    trust_remote_code: bool = False

    @field_validator("layer_ids")
    @classmethod
    def _three_ascending_layers(cls, v: list[int] | None) -> list[int] | None:
        return None if v is None else ascending_layer_ids(v)


class RegenerateSpec(_Strict):
    """Response regeneration: the verifier rewrites every assistant turn before data preparation."""

    max_new_tokens: int = Field(default=512, ge=1, le=32768, description="Longest generated turn, in tokens.")
    temperature: float = Field(default=0.0, ge=0.0, le=2.0, description="0 is greedy decoding.")
    engine: Literal["transformers", "vllm"] = Field(
        default="transformers", description="`transformers` works everywhere; `vllm` where vLLM is installed."
    )
    turns: Literal["all", "first"] = Field(
        default="all",
        description="`all` rewrites every assistant turn; `first` rewrites each conversation's first answer "
        "and keeps the later turns as written (a fraction of the cost on long conversations).",
    )


class DatasetSpec(_Strict):
    """Chat data: an uploaded dataset id (API) or a JSONL path (CLI, or a server path under an allowed root)."""

    id: str | None = Field(default=None, max_length=64)
    path: str | None = Field(default=None, max_length=4096)
    format: Literal["auto", "messages", "sharegpt", "tokenized"] = "auto"
    seq_len: int = Field(default=2048, ge=16, le=131072)
    max_samples: int | None = Field(default=None, ge=1, le=MAX_SAMPLES)
    val_fraction: float = Field(default=0.05, ge=0.0, le=0.5)
    regenerate: RegenerateSpec | None = Field(
        default=None,
        description="false (default), true (the defaults) or the verifier's regeneration settings.",
    )

    @field_validator("regenerate", mode="before")
    @classmethod
    def _bool_shorthand(cls, v: Any) -> Any:
        # false/true are the documented spellings; inside, "off" is None so that errors name one type.
        return {} if v is True else None if v is False else v

    @field_serializer("regenerate")
    def _false_when_off(self, v: RegenerateSpec | None) -> Any:
        return False if v is None else v.model_dump()

    @model_validator(mode="after")
    def _one_source(self) -> DatasetSpec:
        if (self.id is None) == (self.path is None):
            raise ValueError("give exactly one of 'id' (an uploaded dataset) or 'path' (a JSONL file)")
        if self.regenerate and self.format == "tokenized":
            raise ValueError("regenerate needs chat data (messages or sharegpt), not tokenized rows")
        return self


class HiddenStatesSpec(_Strict):
    """Where the verifier's hidden states come from: a cache, online passes, or both (hybrid)."""

    mode: Literal["online", "offline", "hybrid"] = "hybrid"
    cache_uri: str | None = Field(
        default=None,
        max_length=4096,
        description="Cache directory; default: one per (verifier, data) fingerprint.",
    )
    dtype: Literal["bf16", "fp8", "fp32"] = "bf16"
    max_cache_bytes: int | None = Field(default=None, ge=0, le=MAX_CACHE_BYTES)
    engine: Literal["transformers", "vllm"] = Field(
        default="transformers",
        description="Who runs the verifier for hidden states: `transformers` in the training process, or "
        "`vllm` (its own processes, `resources.tensor_parallel_size` x `data_parallel_size` devices). A "
        "hybrid cache's misses are filled by the engine that built it.",
    )
    keep_online: bool = Field(
        default=False,
        description="Online mode with engine vllm: keep the computed shards in the cache directory instead "
        "of deleting them once trained on.",
    )


class ModelSpec(DrafterSettings, _Strict):
    """The drafter: depth and COD sampling (`DrafterSettings`), its draft vocabulary and initialisation."""

    draft_vocab_size: int | None = Field(
        default=DEFAULT_DRAFT_VOCAB_SIZE,
        ge=2,
        le=1 << 22,
        description="Capped at the verifier's vocabulary; null means the full vocabulary.",
    )
    init_from: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="A P-EAGLE or EAGLE-3 checkpoint directory (ours or speculators') to start training from "
        "(of model.method); its architecture and draft vocabulary are kept, and the init_*_from_verifier "
        "options do not apply.",
    )
    init_embeddings_from_verifier: bool = True
    init_lm_head_from_verifier: bool = Field(
        default=True,
        description="Start the drafter's lm_head from the verifier's draft-vocab rows (faster early training).",
    )
    freeze_lm_head: bool = Field(
        default=False,
        description="Keep the lm_head as initialised (the verifier's rows, or `init_from`'s) and train the rest; "
        "needs init_lm_head_from_verifier or init_from.",
    )

    @model_validator(mode="after")
    def _frozen_head_is_initialised(self) -> ModelSpec:
        if self.freeze_lm_head and not (self.init_lm_head_from_verifier or self.init_from):
            raise ValueError(
                "freeze_lm_head keeps a random lm_head unless init_lm_head_from_verifier or init_from"
            )
        return self


class TrainingSpec(_Strict):
    """Optimiser, schedule, batching and checkpoint cadence."""

    epochs: int = Field(default=1, ge=1, le=1000)
    max_steps: int | None = Field(
        default=None, ge=1, le=MAX_STEPS, description="Stop after this many optimizer steps."
    )
    lr: float = Field(default=6e-4, gt=0.0, le=1.0)
    warmup_ratio: float = Field(default=0.03, ge=0.0, le=0.5)
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0)
    weight_decay: float = Field(default=0.01, ge=0.0, le=1.0)
    grad_clip: float | None = Field(default=1.0, gt=0.0, le=1e4)
    total_seq_len: int = Field(default=8192, ge=16, le=1048576)
    grad_accum: int = Field(default=1, ge=1, le=1024)
    num_segments: int = Field(default=1, ge=1, le=64, description="Sequence partitioning for long contexts.")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        default="auto",
        description="Compute precision of the drafter's forward and backward: `auto` is bf16 where the device "
        "has fast bf16 (CUDA, or a CPU with AMX-BF16 or AVX512-BF16) and fp32 elsewhere. Master weights, "
        "optimizer state and the loss stay fp32 in every precision.",
    )
    compile: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Compile the drafter's training forward and backward with TorchInductor (norms, rotary, "
        "SwiGLU, residuals and casts fused around the attention kernels): `auto` compiles on a CPU, on one "
        "rank, for P-EAGLE runs of at least 250 optimizer steps, where the ~25 s it costs once pays back; "
        "`on` wherever one rank trains; `off` never. `PEAGLE_COMPILE=0` turns it off too.",
    )
    optimizer: Literal["adamw", "muon"] = Field(
        default="adamw",
        description="`muon`: torch's Muon for the decoder's weight matrices (its update matched to AdamW's "
        "RMS, so `lr` and `weight_decay` carry over) and AdamW for embeddings, lm_head and norms; ddp only.",
    )
    depth_weights: (
        Literal["count", "equal"]
        | Annotated[list[Annotated[float, Field(ge=0.0, le=1e6)]], Field(max_length=32)]
    ) = Field(
        default="count",
        description="How the loss weighs the depths: `count` is the mean over every sampled row (depths weigh "
        "as many rows as COD gives them, the reference's); `equal` gives each depth the same share; a list "
        "[w0, ...] (one per model.num_depths) gives depth d the share w_d / sum(w).",
    )
    tv_weight: float = Field(
        default=0.0,
        ge=0.0,
        le=100.0,
        description="Adds tv_weight x the total-variation distance between the verifier's and the drafter's "
        "distributions to each row's KL (1 - TV is a sampled draft's acceptance chance).",
    )
    in_vocab_targets_only: bool = Field(
        default=False,
        description="Train only on positions whose verifier top-1 (over its whole vocabulary) is in the draft "
        "vocabulary; elsewhere no draft can be accepted.",
    )
    sharding: Literal["ddp", "fsdp"] = Field(
        default="ddp",
        description="How ranks share the drafter: `ddp` replicates it; `fsdp` shards weights, gradients and "
        "optimizer state over the ranks (FSDP2, per decoder layer plus the root; bf16 compute on CUDA).",
    )
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    checkpoint_every_steps: int = Field(default=500, ge=1, le=MAX_STEPS)
    eval_every_steps: int | None = Field(default=None, ge=1, le=MAX_STEPS)
    max_nonfinite_steps: int = Field(
        default=20,
        ge=1,
        le=100_000,
        description="Fail with code `diverged` after this many consecutive steps whose loss is NaN or infinite.",
    )


class EvalPrompt(_Strict):
    """An evaluation prompt with the category its figures are grouped under (e.g. MT-Bench's)."""

    free_text_fields: ClassVar[frozenset[str]] = frozenset({"prompt"})

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    category: str | None = Field(default=None, min_length=1, max_length=MAX_CATEGORY_CHARS)


class EvaluationSpec(_Strict):
    """Acceptance-length evaluation against the verifier on held-out prompts."""

    free_text_fields: ClassVar[frozenset[str]] = frozenset({"prompts"})

    prompts: int | list[Annotated[str, Field(min_length=1)] | EvalPrompt] = Field(
        default=16,
        description=f"How many held-out prompts (at most 10000), or the prompts themselves (at most "
        f"{MAX_PROMPTS}, each up to {MAX_PROMPT_CHARS} characters): a string, or "
        '{"prompt": ..., "category": ...} to see acceptance per category.',
    )
    max_new_tokens: int = Field(default=64, ge=1, le=4096)
    speculative_tokens: list[Annotated[int, Field(ge=1, le=32)]] | None = Field(
        default=None,
        max_length=32,
        description="K values to evaluate (deduplicated, sorted, each <= model.num_depths); default "
        "[num_depths].",
    )
    engine: Literal["auto", "peagle", "vllm", "both"] = Field(
        default="auto",
        description="Who measures acceptance length: our decoder (`peagle`), vLLM's spec-decode counters "
        "(`vllm`) or `both`; `auto` is `both` where vLLM is installed, else `peagle`.",
    )
    measure_speedup: bool = Field(
        default=False,
        description="After the publish gate, time vLLM on the evaluation prompts without a speculator, with "
        "the drafter and with vLLM's ngram speculator at each evaluated K and each of speedup_batch_sizes, "
        "and record the speed-ups and the K to serve with; needs vLLM and export.vllm_check.",
    )
    speedup_batch_sizes: list[Annotated[int, Field(ge=1, le=64)]] = Field(
        default=[1, 8],
        min_length=1,
        max_length=4,
        description="Batch sizes the speed-up is measured at (capped at the number of prompts): each one "
        "times every prompt once per round and side.",
    )
    speedup_rounds: int = Field(
        default=3, ge=1, le=10, description="Paired timing rounds per speed-up; the median round's counts."
    )

    @field_validator("prompts")
    @classmethod
    def _some_prompts(cls, v: int | list[str | EvalPrompt]) -> int | list[str | EvalPrompt]:
        if isinstance(v, int) and not 0 <= v <= 10000:
            raise ValueError("must be between 0 and 10000")
        if isinstance(v, list) and len(v) == 0:
            raise ValueError("give at least one prompt, or a count")
        if isinstance(v, list) and len(v) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts, got {len(v)}")
        texts = [p if isinstance(p, str) else p.prompt for p in v] if isinstance(v, list) else []
        if long := [i for i, p in enumerate(texts) if len(p) > MAX_PROMPT_CHARS]:
            raise ValueError(f"prompt {long[0]} is longer than {MAX_PROMPT_CHARS} characters")
        return v

    @field_validator("speculative_tokens", "speedup_batch_sizes")
    @classmethod
    def _distinct_ks(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and not v:
            raise ValueError("must be a non-empty list of integers >= 1")
        return None if v is None else sorted(set(v))


class ExportSpec(_Strict):
    """The published checkpoint."""

    dtype: Literal["bf16", "fp32"] = Field(
        default="bf16",
        description="Weights dtype of the exported checkpoint (speculators checkpoints are bf16).",
    )
    vllm_check: bool = Field(
        default=True,
        description="Load the checkpoint in vLLM and check its greedy output before publishing, where vLLM "
        "is installed (elsewhere it is published `unverified`).",
    )


class ResourcesSpec(_Strict):
    """What the job runs on."""

    gpus: int = Field(default=1, ge=1, le=64)
    queue: str = Field(default="default", pattern=_QUEUE_PATTERN)
    tensor_parallel_size: int = Field(
        default=1, ge=1, le=64, description="vLLM hidden-state engine: devices per verifier replica."
    )
    data_parallel_size: int = Field(
        default=1, ge=1, le=64, description="vLLM hidden-state engine: verifier replicas."
    )
    nodes: int | str = Field(
        default=1,
        description=f'Machines the job trains on (`gpus` each): N (1-{MAX_NODES}), or "MIN:MAX" for an '
        "elastic job that goes on, from its last checkpoint, while at least MIN machines remain.",
    )

    @field_validator("nodes", mode="before")
    @classmethod
    def _node_count(cls, v: Any) -> int | str:
        if isinstance(v, int) and not isinstance(v, bool):
            if not 1 <= v <= MAX_NODES:
                raise ValueError(f"must be between 1 and {MAX_NODES}, got {v}")
            return v
        if isinstance(v, str) and len(v) <= 8:
            low, sep, high = v.partition(":")
            if sep and low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high) <= MAX_NODES:
                return f"{int(low)}:{int(high)}"
        raise ValueError(
            f'give a node count (1-{MAX_NODES}) or "MIN:MAX" with 1 <= MIN <= MAX <= {MAX_NODES}'
        )

    @property
    def nodes_min(self) -> int:
        return self.nodes if isinstance(self.nodes, int) else int(self.nodes.split(":")[0])

    @property
    def nodes_max(self) -> int:
        return self.nodes if isinstance(self.nodes, int) else int(self.nodes.split(":")[1])

    @property
    def elastic(self) -> bool:
        """Whether the job may go on with fewer machines than it started on (MIN < MAX)."""
        return self.nodes_min < self.nodes_max

    @property
    def nominal_world_size(self) -> int:
        """Ranks at full strength (gpus x the most nodes): what batch sizes and schedules are sized for, so
        that a run that loses or gains a machine keeps the same global batch."""
        return self.gpus * self.nodes_max


class TrackingSpec(_Strict):
    """Experiment trackers the job also reports to (besides the service's own metrics)."""

    report_to: list[Literal["tensorboard", "mlflow"]] = Field(
        default_factory=list,
        max_length=2,
        description="tensorboard: event files in the job's artifact folder (GET /v1/jobs/{id}/tensorboard); "
        "mlflow: a run on the operator's PEAGLE_MLFLOW_TRACKING_URI. A failing tracker never fails the job.",
    )

    @field_validator("report_to")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("list each tracker once")
        return v


class JobSpec(_Strict):
    """A whole training job."""

    name: str | None = Field(default=None, max_length=200)
    verifier: VerifierSpec
    dataset: DatasetSpec
    hidden_states: HiddenStatesSpec = Field(default_factory=HiddenStatesSpec)
    model: ModelSpec = Field(default_factory=ModelSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    evaluation: EvaluationSpec = Field(default_factory=EvaluationSpec)
    export: ExportSpec = Field(default_factory=ExportSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)

    @model_validator(mode="after")
    def _cross_field(self) -> JobSpec:
        ks = self.evaluation.speculative_tokens
        if ks is not None and max(ks) > self.model.num_depths:
            raise ValueError(
                f"evaluation.speculative_tokens: K={max(ks)} exceeds model.num_depths={self.model.num_depths}"
            )
        res = self.resources
        if res.tensor_parallel_size * res.data_parallel_size > 1:
            if self.hidden_states.engine != "vllm":
                raise ValueError(
                    "resources.tensor_parallel_size/data_parallel_size apply to hidden_states.engine: vllm"
                )
            if res.tensor_parallel_size * res.data_parallel_size > res.gpus:
                raise ValueError(
                    f"resources: tensor_parallel_size x data_parallel_size "
                    f"({res.tensor_parallel_size * res.data_parallel_size}) exceeds gpus ({res.gpus})"
                )
        if res.nodes_max > 1 and self.hidden_states.engine == "vllm":
            raise ValueError(
                "resources.nodes: a job across machines computes hidden states in its training ranks; "
                "use hidden_states.engine: transformers"
            )
        if self.training.total_seq_len < self.dataset.seq_len:
            raise ValueError(
                f"training.total_seq_len ({self.training.total_seq_len}) must be >= dataset.seq_len "
                f"({self.dataset.seq_len}) so that every sample fits a packed row"
            )
        weights = self.training.depth_weights
        if isinstance(weights, list) and (len(weights) != self.model.row_depths or not sum(weights) > 0):
            per = "model.ttt_steps" if self.model.method == "eagle3" else "model.num_depths"
            raise ValueError(
                f"training.depth_weights: give {self.model.row_depths} weights ({per}), not all 0"
            )
        if self.training.optimizer == "muon" and self.training.sharding == "fsdp":
            raise ValueError("training.optimizer: muon orthogonalises whole matrices; use sharding: ddp")
        if self.evaluation.measure_speedup and not self.export.vllm_check:
            raise ValueError(
                "evaluation.measure_speedup: the speed-up is measured by the publish gate, which "
                "export.vllm_check: false switches off"
            )
        return self

    @property
    def speculative_tokens(self) -> list[int]:
        return self.evaluation.speculative_tokens or [self.model.num_depths]


class SpecError(PeagleError, ValueError):
    """A spec that does not validate; `errors` lists (param, message) pairs naming each bad field."""

    code = "invalid_spec"

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = errors
        first = errors[0][0] if errors else None
        super().__init__("; ".join(f"{p}: {m}" if p else m for p, m in errors), param=first or None)


def validation_errors(exc: ValidationError) -> list[tuple[str, str]]:
    """Turn a pydantic error into (dotted field path, message) pairs a user can act on."""
    out = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
        msg = number_problem(err.get("input")) or err["msg"].removeprefix("Value error, ")
        out.append((loc, msg))
    return out


def parse_spec(data: Any) -> JobSpec:
    """Validate a dict (already parsed JSON/YAML) into a JobSpec, raising SpecError naming the fields."""
    if not isinstance(data, dict):
        raise SpecError([("", "a job spec must be a mapping (JSON object / YAML mapping)")])
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(validation_errors(exc)) from None


def load_spec(path: str | Path) -> JobSpec:
    """Read a YAML or JSON spec file; parse errors name the line, validation errors name the field."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise SpecError([("", f"cannot read spec file {p}: {exc.strerror}")]) from None
    try:
        data = load_json_document(text) if p.suffix == ".json" else load_yaml(text)
    except DocumentError as exc:
        raise SpecError([("", f"{p}: {exc}")]) from None
    except json.JSONDecodeError as exc:
        raise SpecError([("", f"{p}: invalid JSON at line {exc.lineno}: {exc.msg}")]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise SpecError([("", f"{p}: invalid YAML{where}: {getattr(exc, 'problem', exc)}")]) from None
    return parse_spec(data)
