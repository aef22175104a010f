"""Real vLLM loads every shape of checkpoint we export; with the drafter its greedy output is unchanged,
its acceptance length agrees with ours, and the publish gate refuses what vLLM refuses, or what vLLM
loads but drafts badly with (acceptance below the floor ours sets)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from peagle_core.serving.gate import NotServableError, ServingCheck, check_in_vllm
from tests.fixtures.vllm import SERVING_NEW_TOKENS
from tests.integration.conftest import SHAPES

CASES = [(shape.name, k) for shape in SHAPES for k in range(1, shape.num_depths + 1)]


def test_plain_greedy_reference_is_not_degenerate(plain_greedy: list[list[int]]) -> None:
    # A verifier that repeats one token would make every drafter look perfect.
    assert all(len(set(tokens)) >= 4 for tokens in plain_greedy)


@pytest.mark.parametrize(("shape", "k"), CASES, ids=[f"{s}-K{k}" for s, k in CASES])
def test_vllm_serves_every_shape_with_unchanged_greedy_output(
    vllm_engine, exported_drafters, toy_verifier_dir, serving_prompts, plain_greedy, shape: str, k: int
) -> None:
    run = vllm_engine.generate(
        str(toy_verifier_dir), serving_prompts, SERVING_NEW_TOKENS, drafter=str(exported_drafters[shape]), k=k
    )
    assert run.tokens == plain_greedy
    assert run.num_drafts > 0 and run.num_draft_tokens == k * run.num_drafts  # the drafter really ran
    assert len(run.accepted_per_position) == k
    assert 1.0 <= run.acceptance_length <= k + 1


@pytest.fixture(scope="module")
def ours_at_3(exported_drafters, toy_verifier, serving_prompts):
    """Our evaluator on the serving prompts with the 1-layer drafter at K=3 (the published bf16 weights,
    as vLLM reads them)."""
    from peagle_core.evaluation.acceptance import evaluate
    from peagle_core.model.drafter import PEagleDraftModel

    drafter = PEagleDraftModel.from_pretrained(exported_drafters["draft-vocab-1-layer"])
    prompts = [torch.tensor(p) for p in serving_prompts]
    return evaluate(
        drafter, toy_verifier, prompts, 3, SERVING_NEW_TOKENS, toy_verifier.tokenizer.eos_token_id
    )


def test_acceptance_length_agrees_with_vllm(
    vllm_engine, exported_drafters, toy_verifier_dir, serving_prompts, ours_at_3
) -> None:
    from peagle_core.serving.judge import GAP_TOLERANCE, agreement_gap

    path, k, ours = exported_drafters["draft-vocab-1-layer"], 3, ours_at_3
    theirs = vllm_engine.generate(
        str(toy_verifier_dir), serving_prompts, SERVING_NEW_TOKENS, drafter=str(path), k=k
    )
    assert ours.tokens == theirs.tokens  # the same greedy chain...
    assert ours.acceptance_length > 1.1  # ...with a drafter that accepts something...
    assert (
        agreement_gap(ours.acceptance_length, theirs.acceptance_length) <= GAP_TOLERANCE
    )  # ...counted alike
    for a, b in zip(ours.acceptance_rate_per_position, theirs.acceptance_rate_per_position, strict=True):
        assert abs(a - b) <= 0.05


def _check(engine, verifier: Path, checkpoint: Path, prompts, reference, k: int, ours=None) -> ServingCheck:
    return check_in_vllm(
        engine,
        verifier=str(verifier),
        checkpoint_dir=checkpoint,
        prompts=prompts,
        k=k,
        max_new_tokens=SERVING_NEW_TOKENS,
        reference=reference,
        ours=ours,
    )


def _with_full_vocab_map(src: Path, dst: Path) -> Path:
    """The checkpoint as our export wrote it before the fix: d2t/t2d beside a full draft vocabulary."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    vocab = tensors["lm_head.weight"].shape[0]
    tensors["d2t"] = torch.zeros(vocab, dtype=torch.long)
    tensors["t2d"] = torch.ones(vocab, dtype=torch.bool)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_the_gate_refuses_a_checkpoint_vllm_refuses_and_publishes_nothing(
    vllm_engine, exported_drafters, toy_verifier_dir, serving_prompts, plain_greedy, tmp_path
) -> None:
    from peagle_core.model.drafter import PEagleDraftModel
    from peagle_core.serving.export import export_checkpoint

    bad = _with_full_vocab_map(exported_drafters["full-vocab-4-layers"], tmp_path / "bad")
    with pytest.raises(NotServableError) as err:
        _check(vllm_engine, toy_verifier_dir, bad, serving_prompts, plain_greedy, k=2)
    assert err.value.code == "export_not_servable"
    assert "draft_id_to_target_id" in str(err.value)  # vLLM's own words

    # Through the export: the gate runs on the finished temporary directory, so nothing appears.
    model = PEagleDraftModel.from_pretrained(exported_drafters["full-vocab-4-layers"])

    def gate(tmp: Path) -> ServingCheck:
        _with_full_vocab_map(tmp, tmp_path / "tampered")
        return _check(
            vllm_engine, toy_verifier_dir, tmp_path / "tampered", serving_prompts, plain_greedy, k=2
        )

    out = tmp_path / "published"
    with pytest.raises(NotServableError):
        export_checkpoint(model, out, verifier_name_or_path=str(toy_verifier_dir), serving=gate)
    assert not out.exists()


def _with_shifted_d2t(src: Path, dst: Path) -> Path:
    """A copy of an export that loads in vLLM and stays lossless but drafts the wrong tokens: its draft
    vocabulary map shifted by one id, so each draft id maps to the token its neighbour stands for."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    ids = torch.arange(len(tensors["d2t"]))
    tensors["d2t"] = torch.roll(tensors["d2t"] + ids, 1) - ids
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_the_gate_fails_a_drafter_whose_acceptance_collapses_in_vllm(
    vllm_engine, exported_drafters, toy_verifier_dir, serving_prompts, plain_greedy, ours_at_3, tmp_path
) -> None:
    # (Wrong aux layer ids are no collapse on the toy: its layers are alike, and bench/gate_noise.py
    # measured vLLM's acceptance length 5% lower with them; only the d2t case is a test.)
    bad = _with_shifted_d2t(exported_drafters["draft-vocab-1-layer"], tmp_path / "bad")
    ours = ours_at_3
    run = vllm_engine.generate(
        str(toy_verifier_dir), serving_prompts, SERVING_NEW_TOKENS, drafter=str(bad), k=3
    )
    assert run.tokens == plain_greedy  # lossless: the output check alone would publish it
    with pytest.raises(NotServableError) as err:
        _check(vllm_engine, toy_verifier_dir, bad, serving_prompts, plain_greedy, k=3, ours=ours)
    assert err.value.code == "export_not_servable"
    message = str(err.value)
    assert f"vLLM's acceptance length at K=3 is {run.acceptance_length:.3f}" in message
    assert f"against {ours.acceptance_length:.3f} in our evaluation on the same 8 prompts" in message
    floor = float(re.search(r"floor of ([0-9.]+)", message).group(1))
    assert run.acceptance_length < floor < ours.acceptance_length


def test_a_verified_export_records_the_check_beside_the_weights(
    vllm_engine, exported_drafters, toy_verifier_dir, serving_prompts, plain_greedy, ours_at_3, tmp_path
) -> None:
    from peagle_core.model.drafter import PEagleDraftModel
    from peagle_core.serving.export import export_checkpoint
    from tests.integration.conftest import SHAPES

    # The bf16-trained drafter (training.precision: bf16) passes the gate like an fp32-trained one.
    assert {s.name: s.precision for s in SHAPES}["draft-vocab-1-layer"] == "bf16"
    model = PEagleDraftModel.from_pretrained(exported_drafters["draft-vocab-1-layer"])
    ours = ours_at_3

    def gate(tmp: Path) -> ServingCheck:
        return _check(vllm_engine, toy_verifier_dir, tmp, serving_prompts, plain_greedy, k=3, ours=ours)

    out = export_checkpoint(model, tmp_path / "ok", verifier_name_or_path=str(toy_verifier_dir), serving=gate)
    check = ServingCheck.load(out)
    assert check is not None and check.status == "verified" and check.k == 3
    assert check.prompts == len(serving_prompts) and check.acceptance_length >= 1.0
    # The uncorrupted drafter clears the floor its own evaluation sets, and the check records both.
    assert check.ours_acceptance_length == ours.acceptance_length
    assert check.acceptance_floor is not None and 1.0 < check.acceptance_floor <= check.acceptance_length
    card = (out / "README.md").read_text()
    assert "servable: **verified** by vllm 0.32.0" in card
    assert f"acceptance length at K=3: {check.acceptance_length:.3f}" in card
    assert f"our evaluation on the same prompts: {ours.acceptance_length:.3f}" in card


def test_peagle_eval_reports_both_engines_on_the_same_prompts(
    exported_drafters, toy_verifier_dir, toy_dataset_path
) -> None:
    import json
    import subprocess
    import sys

    from peagle_core.serving.judge import GAP_TOLERANCE

    drafter = exported_drafters["draft-vocab-1-layer"]
    res = subprocess.run(
        [sys.executable, "-m", "cli", "eval", "--drafter", str(drafter), "--verifier", str(toy_verifier_dir),
         "--data", str(toy_dataset_path), "-k", "3", "--prompts", "4", "--max-new-tokens", "16",
         "--seq-len", "128", "--engine", "both"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    (row,) = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert row["k"] == 3 and row["num_prompts"] == 4
    assert row["vllm"]["matches_greedy"] is True and row["vllm"]["num_prompts"] == 4
    assert row["gap"] <= GAP_TOLERANCE


def test_the_judge_reports_categories_and_vllms_speedups_and_how_to_serve(
    vllm_engine, exported_drafters, toy_verifier_dir, serving_prompts, plain_greedy, ours_at_3, monkeypatch
) -> None:
    from peagle_core.serving import judge as judge_module
    from peagle_core.serving.judge import VllmJudge
    from peagle_core.serving.recommendation import ServingRecommendation

    started: list[object] = []

    class CountedProcess(judge_module.VllmProcess):
        def start(self):
            if self._child is None:
                started.append(self)
            return super().start()

    monkeypatch.setattr(judge_module, "VllmProcess", CountedProcess)
    categories = ["even" if i % 2 == 0 else None for i in range(len(serving_prompts))]
    judge = VllmJudge(
        str(toy_verifier_dir), serving_prompts, SERVING_NEW_TOKENS, categories=categories, process=vllm_engine
    )
    assert judge.reference() == plain_greedy
    check = judge.gate(
        exported_drafters["draft-vocab-1-layer"],
        3,
        ours=ours_at_3,
        measure_speedup=True,
        speedup_ks=[1, 3],
        speedup_batch_sizes=[1, 8],
        speedup_rounds=1,  # one paired round: the figures' structure is what this test checks
    )
    judge.close()
    assert vllm_engine.generate(str(toy_verifier_dir), serving_prompts[:1], 2).tokens  # still the session's
    # Engine processes beside the judge's: the plain side's, which ends with the last ngram K, and one for
    # the other ngram K; every one closed.
    assert len(started) == 2 and all(p._child is None for p in started)
    # Each category decoded as its own batch; pooled, they are the whole set's figures.
    cats = check.categories
    assert list(cats) == ["even", "uncategorised"]
    assert [c.num_prompts for c in cats.values()] == [4, 4]
    assert sum(c.drafts for c in cats.values()) == check.drafts
    pooled = sum(c.acceptance_length * c.drafts for c in cats.values()) / check.drafts
    assert pooled == pytest.approx(check.acceptance_length)
    # Every speculator (the drafter, vLLM's ngram), K and batch size, each timed against plain decoding on
    # both engines in alternating pairs, every prompt once per round, the output unchanged.
    rows = {(r.method, r.k, r.batch_size): r.to_dict() for r in check.speedups}
    assert sorted(rows) == sorted((m, k, b) for m in ("eagle3", "ngram") for k in (1, 3) for b in (1, 8))
    for r in rows.values():
        assert (r["prompts"], r["rounds"], r["paired"], len(r["speedup_per_round"])) == (8, 1, "per group", 1)
        assert r["lossless"] is True and r["acceptance_length"] >= 1.0
        assert r["output_tokens_per_s"] > 0 and r["baseline_output_tokens_per_s"] > 0
        assert r["speedup"] == pytest.approx(r["speedup_per_round"][0], abs=1e-4)
    assert rows[("eagle3", 3, 1)]["acceptance_length"] > 1.0  # the drafter drafted
    # the gate's K at batch 1, as before
    assert check.speedup is not None and check.speedup.to_dict() == rows[("eagle3", 3, 1)]
    # The recommendation is drawn from those rows: the served K is the best at the first batch size where
    # one beats plain decoding, and the sentence carries it.
    rec = ServingRecommendation.of(check.to_dict())
    assert rec is not None and rec == ServingRecommendation.choose(check.speedups)
    assert [b.batch_size for b in rec.batches] == [1, 8]
    for b in rec.batches:
        mine = {k: rows[("eagle3", k, b.batch_size)]["speedup"] for k in (1, 3)}
        assert b.best_k == max(mine, key=lambda k: (mine[k], -k)) and b.best_speedup == mine[b.best_k]
        assert b.ngram_speedup == max(rows[("ngram", k, b.batch_size)]["speedup"] for k in (1, 3))
    beats = [b for b in rec.batches if b.best_speedup > 1.0]
    if beats:
        assert rec.k == beats[0].best_k
        assert rec.sentence().startswith(f"serve the P-EAGLE drafter with num_speculative_tokens={rec.k}:")
    else:
        assert rec.k is None and rec.sentence().startswith("no num_speculative_tokens beat plain decoding")
