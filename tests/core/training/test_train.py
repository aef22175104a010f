"""The trainer: a full small run, cooperative stop, SIGKILL + resume equality, and sequence partitioning."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from peagle_core.events import CallbackReporter
from peagle_core.serving.export import validate_checkpoint
from peagle_core.spec import JobSpec
from peagle_core.training.loop import train
from peagle_core.training.resume import latest_checkpoint
from tests.core.helpers import assert_same_weights, final_weights, make_spec
from tests.fixtures.wait import wait_until

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def spec_for(toy_verifier_dir: Path, toy_dataset_path: Path):
    def build(**training) -> JobSpec:
        return make_spec(toy_verifier_dir, toy_dataset_path, **training)

    return build


def test_full_run_reports_checkpoints_evaluates_and_exports(
    spec_for, prepared_dataset: Path, tmp_path: Path
) -> None:
    spec = spec_for(max_steps=4, checkpoint_every_steps=2, eval_every_steps=2, grad_accum=2, warmup_ratio=0.5)
    metrics, events = [], []
    result = train(
        spec,
        tmp_path / "run",
        dataset_dir=prepared_dataset,
        reporter=CallbackReporter(events=lambda e: events.append(e.kind), metrics=metrics.append),
    )
    assert result.status == "completed" and result.step == 4

    steps = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    for m in steps:
        assert m["total_steps"] == 4 and m["epoch"] == 0
        assert {"acc_0", "acc_1", "acc_2", "lr", "tokens_per_s", "eta_s"} <= m.keys()
        assert torch.isfinite(torch.tensor(m["loss"]))
    assert steps[0]["lr"] < steps[1]["lr"]  # warmup, then cosine decay
    assert steps[1]["lr"] > steps[3]["lr"]
    evals = [m for m in metrics if "eval/acceptance_length@3" in m or "eval/acceptance_length@1" in m]
    assert {m["step"] for m in evals} == {2, 4}
    # The caller prepared the data (dataset_dir), so the trainer's stages start at hidden states; the
    # evaluation at step 2 is an event within training, the one at the last step is the eval stage.
    stages = [k for k in events if k in ("prepare", "hidden_states", "train", "eval", "export")]
    assert stages == ["hidden_states", "train", "eval", "export"]
    assert events.count("evaluation") == 1 and "data" in events

    ckpts = tmp_path / "run" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000004"
    eval_json = json.loads((ckpts / "step_00000004" / "eval.json").read_text())
    assert set(eval_json["results"]) == {"k=1", "k=3"}

    assert result.export_dir == tmp_path / "run" / "export" / "step_4"
    from transformers import AutoConfig

    verifier_config = AutoConfig.from_pretrained(spec.verifier.name_or_path)
    assert validate_checkpoint(result.export_dir, verifier_config) == []
    assert load_file(str(result.export_dir / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    assert (result.export_dir / "eval.json").is_file()
    assert "eval/acceptance_length@3" in result.metrics


def test_stop_then_resume_equals_an_uninterrupted_run(
    spec_for, prepared_dataset: Path, tmp_path: Path
) -> None:
    spec = spec_for(max_steps=5, checkpoint_every_steps=100, eval_every_steps=None)
    spec.evaluation.prompts = 1

    ref = train(spec, tmp_path / "ref", dataset_dir=prepared_dataset)
    assert ref.status == "completed"

    seen = []
    stopped = train(
        spec,
        tmp_path / "run",
        dataset_dir=prepared_dataset,
        reporter=CallbackReporter(metrics=seen.append),
        should_stop=lambda: len(seen) >= 2,
    )
    assert stopped.status == "stopped" and stopped.step == 2 and stopped.export_dir is None
    assert stopped.checkpoint_dir.name == "step_00000002"

    resumed = train(spec, tmp_path / "run", dataset_dir=prepared_dataset)
    assert resumed.status == "completed" and resumed.step == 5
    assert_same_weights(final_weights(tmp_path / "ref"), final_weights(tmp_path / "run"))


_KILL_SCRIPT = """
import sys, threading
from peagle_core.spec import load_spec
from peagle_core.events import CallbackReporter
from peagle_core.training.loop import train
from tests.core.helpers import assert_same_weights, final_weights, make_spec

spec = load_spec(sys.argv[1])
stall_at = int(sys.argv[4])

def on_metrics(m):
    # Simulate a worker that hangs mid-run (after a checkpoint exists) until it is SIGKILLed.
    if m.get("step") == stall_at:
        print("STALLED", flush=True)
        threading.Event().wait()

train(spec, sys.argv[2], dataset_dir=sys.argv[3], reporter=CallbackReporter(metrics=on_metrics))
"""


def test_sigkill_then_resume_equals_an_uninterrupted_run(
    spec_for, prepared_dataset: Path, tmp_path: Path
) -> None:
    spec = spec_for(max_steps=6, checkpoint_every_steps=2, grad_accum=2)
    spec.evaluation.prompts = 1
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(spec.model_dump_json())
    script = tmp_path / "run_train.py"
    script.write_text(_KILL_SCRIPT)
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

    proc = subprocess.Popen(
        [sys.executable, str(script), str(spec_file), str(out), str(prepared_dataset), "3"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def checkpointed() -> bool:
        assert proc.poll() is None, proc.stderr.read()
        return (out / "checkpoints" / "latest").exists()

    try:
        wait_until(checkpointed, message="the first checkpoint", timeout=300)
        assert proc.stdout.readline().strip() == "STALLED"  # past the step-2 checkpoint, before step 4's
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert latest_checkpoint(out / "checkpoints").name == "step_00000002"

    # One thread here (autouse fixture) as in the subprocess, so every run sums in the same order.
    resumed = train(spec, out, dataset_dir=prepared_dataset)
    reference = train(spec, tmp_path / "ref", dataset_dir=prepared_dataset)
    assert resumed.status == "completed" and resumed.step == 6
    assert reference.step == 6
    assert_same_weights(final_weights(tmp_path / "ref"), final_weights(out))


def test_partitioned_step_equals_unpartitioned(toy_verifier, prepared_dataset: Path, spec_for) -> None:
    from peagle_core.data import PreparedDataset
    from peagle_core.data.packing import pack_bins
    from peagle_core.hidden_states.backends import make_source
    from peagle_core.hidden_states.loader import BatchLoader
    from peagle_core.training.builders import build_model, build_teacher
    from peagle_core.training.loop import forward_backward

    spec = spec_for()
    ds = PreparedDataset.open(prepared_dataset)
    torch.manual_seed(0)
    model = build_model(spec, toy_verifier, ds, torch.device("cpu"))
    teacher = build_teacher(toy_verifier, model)
    bins = pack_bins(ds.lengths, 256, seed=0, epoch=0)
    source = make_source("online", ds, verifier_factory=lambda: toy_verifier)
    batch = next(iter(BatchLoader(ds, source, bins[:1], total_seq_len=256)))

    def grads(num_segments: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        m = copy.deepcopy(model)
        metrics = forward_backward(
            m,
            teacher,
            batch,
            num_segments=num_segments,
            generator=torch.Generator().manual_seed(3),
            scale=0.5,
        )
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}, metrics

    whole, whole_metrics = grads(1)
    parts, parts_metrics = grads(4)
    assert whole.keys() == parts.keys() and len(whole) > 0
    for name in whole:
        torch.testing.assert_close(parts[name], whole[name], rtol=1e-4, atol=1e-6, msg=name)
    torch.testing.assert_close(parts_metrics["loss"], whole_metrics["loss"], rtol=1e-5, atol=1e-6)


def test_hybrid_second_epoch_reads_the_cache_without_the_verifier(
    toy_verifier_dir: Path, toy_dataset_path: Path, prepared_dataset: Path, tmp_path: Path
) -> None:
    spec = make_spec(toy_verifier_dir, toy_dataset_path, mode="hybrid", epochs=2, checkpoint_every_steps=1000)
    spec.evaluation.prompts = 1
    epochs = []
    result = train(
        spec,
        tmp_path / "run",
        dataset_dir=prepared_dataset,
        reporter=CallbackReporter(events=lambda e: e.kind == "epoch" and epochs.append(e.data)),
    )
    assert result.status == "completed"
    assert [e["epoch"] for e in epochs] == [0, 1]
    first, second = epochs
    assert first["verifier_calls"] > 0 and first["cache_misses"] > 0
    assert second["verifier_calls"] == 0 and second["cache_misses"] == 0
    assert second["cache_hits"] == first["cache_misses"]  # every sample computed once, then read
    assert result.metrics["verifier_calls"] == first["verifier_calls"]


@pytest.mark.parametrize("init", [True, False])
def test_lm_head_starts_from_the_verifier_rows_when_asked(
    spec_for, toy_verifier, prepared_dataset: Path, init: bool
) -> None:
    from peagle_core.data import PreparedDataset
    from peagle_core.training.builders import build_model

    spec = spec_for()
    spec.model.init_lm_head_from_verifier = init
    dataset = PreparedDataset.open(prepared_dataset)
    model = build_model(spec, toy_verifier, dataset, torch.device("cpu"))
    rows = toy_verifier.lm_head_weight[torch.arange(dataset.d2t.numel()) + dataset.d2t].float()
    assert torch.equal(model.lm_head.weight.detach(), rows) is init


def test_layer_ids_given_in_any_order_train_in_layer_order(spec_for, prepared_dataset: Path) -> None:
    from peagle_core.data import PreparedDataset
    from peagle_core.hidden_states.cache import CacheFingerprint
    from peagle_core.training.builders import build_model, load_verifier

    spec = spec_for()
    spec.verifier.layer_ids = [3, 1, 2]
    assert spec.verifier.layer_ids == [1, 2, 3]  # resolved once, in the spec
    verifier = load_verifier(spec, torch.device("cpu"))
    dataset = PreparedDataset.open(prepared_dataset)
    model = build_model(spec, verifier, dataset, torch.device("cpu"))
    # Hidden-state capture, the cache fingerprint and the exported config all see one order.
    assert verifier.layer_ids == model.config.aux_layer_ids == [1, 2, 3]
    assert list(CacheFingerprint.of(verifier, dataset).layer_ids) == [1, 2, 3]


def _nan_verifier(src: Path, dest: Path) -> Path:
    """A copy of the toy verifier whose input embeddings are NaN: every hidden state, so every loss, is NaN."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, dest)
    weights = load_file(str(dest / "model.safetensors"))
    name = next(k for k in weights if k.endswith("embed_tokens.weight"))
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def test_nonfinite_losses_fail_as_diverged_and_keep_the_last_good_checkpoint(
    spec_for, prepared_dataset: Path, toy_verifier_dir: Path, tmp_path: Path
) -> None:
    from peagle_core.errors import TrainingDiverged

    run = tmp_path / "run"
    good = spec_for(max_steps=2, checkpoint_every_steps=2, eval_every_steps=None)
    good.evaluation.prompts = 1
    train(good, run, dataset_dir=prepared_dataset)
    kept = latest_checkpoint(run / "checkpoints")
    assert kept is not None and kept.name == "step_00000002"
    good_weights = load_file(str(kept / "model.safetensors"))

    # The same run continues against a verifier that went bad: every step from 3 on is NaN.
    bad = good.model_copy(deep=True)
    bad.verifier.name_or_path = str(_nan_verifier(toy_verifier_dir, tmp_path / "nan-verifier"))
    bad.training.max_steps = 10
    bad.training.checkpoint_every_steps = 1
    bad.training.max_nonfinite_steps = 3
    metrics: list[dict] = []
    with pytest.raises(TrainingDiverged) as err:
        train(bad, run, dataset_dir=prepared_dataset, reporter=CallbackReporter(metrics=metrics.append))
    assert err.value.code == "diverged"
    assert err.value.param == "training.max_nonfinite_steps"
    assert "steps 3-5" in err.value.message and "step_00000002" in err.value.message
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == 3 and not any(torch.isfinite(torch.tensor(losses)))

    # No checkpoint was written during the streak; the last good one is intact.
    assert latest_checkpoint(run / "checkpoints") == kept
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*"))[-1] == "step_00000002"
    assert_same_weights(load_file(str(kept / "model.safetensors")), good_weights)


def test_categorised_prompts_are_evaluated_per_category_and_pool_to_the_whole(
    toy_verifier_dir: Path, toy_dataset_path: Path, prepared_dataset: Path, toy_verifier, tmp_path: Path
) -> None:
    from peagle_core.evaluation.acceptance import evaluate
    from peagle_core.spec import parse_spec
    from peagle_core.toy import build_corpus
    from peagle_core.training.builders import heldout_prompt_tokens

    users = [
        next(m["content"] for m in c["messages"] if m["role"] == "user") for c in build_corpus(seed=0)[-3:]
    ]
    raw = make_spec(toy_verifier_dir, toy_dataset_path, max_steps=2).model_dump(mode="json")
    raw["evaluation"]["prompts"] = [
        {"prompt": users[0], "category": "a"},
        users[1],  # no category: grouped as "uncategorised" beside the others
        {"prompt": users[2], "category": "a"},
    ]
    spec = parse_spec(raw)
    metrics: list[dict] = []
    result = train(
        spec,
        tmp_path / "run",
        dataset_dir=prepared_dataset,
        reporter=CallbackReporter(metrics=metrics.append),
    )
    eval_json = json.loads((result.export_dir / "eval.json").read_text())
    r3 = eval_json["results"]["k=3"]
    assert {c: v["num_prompts"] for c, v in r3["categories"].items()} == {"a": 2, "uncategorised": 1}
    assert sum(v["drafts"] for v in r3["categories"].values()) == r3["verifier_passes"]
    # Decoding the categories apart changes nothing: the pooled figures are the ungrouped evaluation's.
    whole = evaluate(result.model, toy_verifier, heldout_prompt_tokens(spec, None, [], toy_verifier), 3, 8,
                     toy_verifier.tokenizer.eos_token_id)  # fmt: skip
    assert r3["acceptance_length"] == pytest.approx(whole.acceptance_length)
    assert r3["acceptance_rate_per_position"] == pytest.approx(whole.acceptance_rate_per_position)
    # Per-position rates are metric-row scalars too.
    final = [m for m in metrics if "eval/acceptance_length@3" in m][-1]
    assert [final[f"eval/acceptance_rate@3_pos{j}"] for j in (1, 2, 3)] == pytest.approx(
        r3["acceptance_rate_per_position"]
    )
