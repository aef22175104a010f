"""End to end through real worker subprocesses: a job is claimed, trained, evaluated and published."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import torch

from peagle_core.model.precision import vllm_dtype
from service.artifacts import ArtifactStore, manifest_sha256
from tests.worker.conftest import PEAGLE, REPO, VLLM_ON, Stack, toy_spec


def test_job_succeeds_and_publishes_a_valid_checkpoint(
    stack: Stack, toy_verifier_dir: Path, toy_dataset_path: Path, tmp_path: Path
) -> None:
    # The whole production path: evaluated by us and by vLLM, published through the vLLM gate, on two
    # prompts of two categories, with vLLM's speed-up measured.
    from peagle_core.toy import build_corpus

    users = [
        next(m["content"] for m in c["messages"] if m["role"] == "user") for c in build_corpus(seed=0)[-2:]
    ]
    evaluation = {
        **VLLM_ON["evaluation"],
        "prompts": [{"prompt": users[0], "category": "first"}, {"prompt": users[1], "category": "second"}],
        "measure_speedup": True,
        "speedup_rounds": 1,  # one paired round: the figures' structure is what this test checks
    }
    job_id = stack.submit(
        toy_spec(toy_verifier_dir, toy_dataset_path, evaluation=evaluation, export=VLLM_ON["export"])
    )
    stack.run_burst()
    job = stack.job(job_id)
    assert job.status == "succeeded", (job.error, [e.message for e in stack.events(job_id)])
    assert job.attempt == 1
    assert job.progress["stage"] == "done"

    # Each stage once, in order, announced by its one owner (the runner prepares, the trainer does the rest);
    # a mid-training evaluation is an event within `train`, not a stage.
    stages = [e.data["stage"] for e in stack.events(job_id) if e.type == "stage"]
    assert stages == ["prepare", "hidden_states", "train", "eval", "export"]

    metrics = stack.metrics(job_id)
    ours = [m["eval/acceptance_length@2"] for m in metrics if "eval/acceptance_length@2" in m]
    theirs = [m["eval/vllm_acceptance_length@2"] for m in metrics if "eval/vllm_acceptance_length@2" in m]
    assert ours and theirs and 1.0 <= theirs[-1] <= 3.0
    train_steps = sorted({m["step"] for m in metrics if "loss" in m})
    assert train_steps == [1, 2, 3, 4]

    (ckpt,) = stack.checkpoints(job_id)
    assert ckpt.step == 4
    assert ckpt.servable == "verified"
    serving = ckpt.metrics["eval"]["serving"]
    assert serving["status"] == "verified" and serving["engine"].startswith("vllm ")
    assert serving["k"] == 2 and serving["prompts"] == 2
    # The collapse check ran against our figure; per category and per position, ours and vLLM's; the speed-up.
    result = ckpt.metrics["eval"]["results"]["k=2"]
    assert serving["ours_acceptance_length"] == result["acceptance_length"]
    assert serving["acceptance_floor"] is None or serving["acceptance_length"] >= serving["acceptance_floor"]
    assert list(result["categories"]) == list(result["vllm"]["categories"]) == ["first", "second"]
    assert (
        len(result["acceptance_rate_per_position"])
        == len(result["vllm"]["acceptance_rate_per_position"])
        == 2
    )
    # Timed in the dtype users serve (bf16 where it is fast): losslessness is the gate's fp32 check above;
    # the timing records its greedy match in that dtype.
    assert serving["speedup"]["dtype"] == vllm_dtype("auto", torch.device("cpu"))
    assert isinstance(serving["speedup"]["lossless"], bool) and serving["speedup"]["speedup"] > 0
    assert ckpt.metrics["eval/vllm_speedup@2"] == serving["speedup"]["speedup"]
    assert_serving_recommendation_shown(stack, job_id, serving)
    assert any("eval/acceptance_rate@2_pos2" in m for m in metrics)
    assert any("eval/vllm_acceptance_rate@2_pos2" in m for m in metrics)
    assert {f["name"] for f in ckpt.files} >= {
        "config.json",
        "model.safetensors",
        "README.md",
        "serving.json",
    }
    assert ckpt.sha256 == manifest_sha256(ckpt.files)
    store = ArtifactStore(stack.settings.artifact_root)
    assert store.verify_files(ckpt.uri, ckpt.files) == []
    # Download it the way a client would (file by file) and validate it with the CLI.
    out = tmp_path / "download"
    for f in ckpt.files:
        dest = out / f["name"]
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(b"".join(store.iter_range(f"{ckpt.uri}/{f['name']}")))
    res = subprocess.run([*PEAGLE, "export", "validate", str(out)], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "servable: **verified** by vllm" in (out / "README.md").read_text()


def assert_serving_recommendation_shown(stack: Stack, job_id: str, serving: dict[str, Any]) -> None:
    """The drafter and vLLM's ngram were timed at K=2, at batch 1 and batch 2 (both prompts: fewer than 8);
    the recommendation drawn from them is on the API, the job page and the CLI's final lines, and the
    serve command carries its K."""
    from fastapi.testclient import TestClient
    from typer.testing import CliRunner

    from cli import build_app
    from peagle_core.serving.recommendation import ServingRecommendation
    from service.app import create_app
    from service.crud.projects import create_key
    from service.db.models import Project
    from tests.fixtures.stack import serve_app
    from tests.service.ui.test_ui import sign_in

    rows = {(r["method"], r["k"], r["batch_size"]): r for r in serving["speedups"]}
    assert sorted(rows) == [("eagle3", 2, 1), ("eagle3", 2, 2), ("ngram", 2, 1), ("ngram", 2, 2)]
    assert serving["speedup"] == rows[("eagle3", 2, 1)]
    rec = ServingRecommendation.of(serving)
    from peagle_core.serving.speedup import Speedup

    rows_typed = [Speedup.from_dict(r) for r in serving["speedups"]]
    assert rec is not None and rec == ServingRecommendation.choose(rows_typed)
    assert [(b.batch_size, b.best_k, b.ngram_k) for b in rec.batches] == [(1, 2, 2), (2, 2, 2)]
    beats = any(rows[("eagle3", 2, b)]["speedup"] > 1.0 for b in (1, 2))
    assert rec.k == (2 if beats else None)
    sentence = rec.sentence()
    assert sentence.startswith(
        "serve the P-EAGLE drafter with num_speculative_tokens=2:" if beats else "no num_speculative_tokens"
    )

    with stack.sessions() as s:
        key, _ = create_key(s, s.get(Project, stack.project_id).name)
    app = create_app(stack.settings)
    with TestClient(app, base_url="http://localhost") as client:
        job = client.get(f"/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"}).json()
        assert job["progress"]["recommendation"] == serving["recommendation"]
        assert job["progress"]["recommendation"]["sentence"] == sentence
        sign_in(client, key)
        page = client.get(f"/ui/jobs/{job_id}/panel?part=details").text
    assert f"How to serve it: <strong>{sentence}</strong>" in page
    assert page.count('<td class="num">2</td><td class="num">1</td>') == 2  # both speculators at batch 1
    assert "&#34;num_speculative_tokens&#34;: 2" in page  # the command's K (the recommended one or the job's)
    with serve_app(app) as url:
        out = CliRunner().invoke(
            build_app(), ["jobs", "logs", job_id, "--follow", "--url", url, "--key", key]
        )
    assert out.exit_code == 0, out.output
    assert out.stdout.splitlines()[-2:] == [f"{job_id}: succeeded", f"measured in vLLM: {sentence}"]


def test_without_the_gate_a_checkpoint_is_published_unverified(
    stack: Stack, toy_verifier_dir: Path, toy_dataset_path: Path
) -> None:
    job_id = stack.submit(toy_spec(toy_verifier_dir, toy_dataset_path, training={"max_steps": 2}))
    stack.run_burst()
    job = stack.job(job_id)
    assert job.status == "succeeded", job.error
    (ckpt,) = stack.checkpoints(job_id)
    assert ckpt.servable == "unverified"
    assert ckpt.metrics["eval"]["serving"] == {
        "status": "unverified",
        "reason": "export.vllm_check is false",
        "engine": None,
        "k": None,
        "prompts": 0,
        "output_tokens": 0,
        "acceptance_length": None,
        "acceptance_rate_per_position": [],
        "drafts": 0,
        "ours_acceptance_length": None,
        "acceptance_floor": None,
        "categories": {},
        "speedup": None,
        "speedups": [],
        "recommendation": None,
    }


def test_missing_verifier_fails_with_a_clear_code(
    stack: Stack, toy_dataset_path: Path, tmp_path: Path
) -> None:
    job_id = stack.submit(toy_spec(tmp_path / "no-such-verifier", toy_dataset_path))
    stack.run_burst()
    job = stack.job(job_id)
    assert job.status == "failed"
    assert job.error["code"] == "verifier_not_found"
    assert "no-such-verifier" in job.error["message"]
    assert "Traceback" not in job.error["message"]
    assert stack.checkpoints(job_id) == []


def test_two_workers_racing_for_one_job_run_it_once(
    stack: Stack, toy_verifier_dir: Path, toy_dataset_path: Path
) -> None:
    from rq import Queue

    job_id = stack.submit(
        toy_spec(toy_verifier_dir, toy_dataset_path, training={"max_steps": 2}), enqueue=False
    )
    # Two deliveries of the same job (as after a duplicate enqueue) to two workers started together.
    q = Queue("default", connection=stack.redis)
    for rq_id in ("dup-a", "dup-b"):
        q.enqueue_call("worker.tasks.run_job", args=(job_id,), job_id=rq_id)
    a, b = stack.worker("--burst"), stack.worker("--burst")
    a.wait(timeout=300)
    b.wait(timeout=300)
    job = stack.job(job_id)
    assert job.status == "succeeded"
    assert job.attempt == 1
    events = stack.events(job_id)
    assert [e.data["status"] for e in events if e.type == "status"] == ["queued", "running", "succeeded"]
    assert sum("skipped the job" in e.message for e in events) == 1
    assert len(stack.checkpoints(job_id)) == 1


def test_jobs_survive_a_redis_flush(stack: Stack, toy_verifier_dir: Path, toy_dataset_path: Path) -> None:
    from worker.reconcile import reconcile_once

    spec = toy_spec(toy_verifier_dir, toy_dataset_path, training={"max_steps": 2})
    jobs = [stack.submit(spec), stack.submit(spec)]
    stack.redis.flushdb()
    report = reconcile_once(stack.settings, redis=stack.redis, min_queued_age_s=0)
    assert set(jobs) <= set(report.reenqueued)
    # A second pass finds them queued in RQ and leaves them be.
    again = reconcile_once(stack.settings, redis=stack.redis, min_queued_age_s=0)
    assert not set(jobs) & set(again.reenqueued)
    stack.run_burst()
    for job_id in jobs:
        job = stack.job(job_id)
        assert job.status == "succeeded"
        assert job.attempt == 1
        statuses = [e.data["status"] for e in stack.events(job_id) if e.type == "status"]
        assert statuses.count("running") == 1


def start_long_job(stack: Stack, verifier_dir: Path, data_path: Path) -> tuple[str, subprocess.Popen[bytes]]:
    """Submit a job far longer than the test and return (job id, worker) once it has trained 2 steps.

    No periodic checkpoint falls inside the run, so any checkpoint found later is one a stop asked for.
    """
    spec = toy_spec(
        verifier_dir, data_path, training={"max_steps": 500, "checkpoint_every_steps": 1000, "epochs": 50}
    )
    job_id = stack.submit(spec)
    worker = stack.worker()
    stack.wait_for("training steps", lambda: (stack.job(job_id).progress or {}).get("step", 0) >= 2)
    return job_id, worker


def stop_checkpoint(stack: Stack, job_id: str) -> str:
    """The name of the job's resume point: its newest training checkpoint mirrored to the store."""
    job = stack.job(job_id)
    assert job.resume_uri is not None
    assert ArtifactStore(stack.settings.artifact_root).exists(f"{job.resume_uri}/meta.json")
    return Path(job.resume_uri).name


def test_cancel_during_training_saves_a_checkpoint(
    stack: Stack, toy_verifier_dir: Path, toy_dataset_path: Path
) -> None:
    from service.crud import jobstate

    job_id, _ = start_long_job(stack, toy_verifier_dir, toy_dataset_path)
    with stack.sessions() as s:
        assert jobstate.transition(s, job_id, "cancelling", expect=("running",), event="cancel requested")
    job = stack.wait_status(job_id, "cancelled", "failed", "succeeded", timeout=120)
    assert job.status == "cancelled"
    (event,) = [e for e in stack.events(job_id) if e.type == "status" and e.data["status"] == "cancelled"]
    step = event.data["step"]
    assert event.data["checkpoint_saved"] is True
    assert f"checkpoint saved at step {step}" in event.message
    assert step < 500
    assert stop_checkpoint(stack, job_id).endswith(f"{step:08d}")
    assert stack.checkpoints(job_id) == []  # nothing published after a cancel


def test_worker_shutdown_checkpoints_requeues_and_the_job_resumes(
    stack: Stack, toy_verifier_dir: Path, toy_dataset_path: Path
) -> None:
    import signal

    from service.crud import jobstate
    from worker.reconcile import reconcile_once

    job_id, worker = start_long_job(stack, toy_verifier_dir, toy_dataset_path)
    worker.send_signal(signal.SIGTERM)  # what a supervisor or a node drain sends
    assert worker.wait(timeout=120) == 0
    stack.procs.remove(worker)

    job = stack.job(job_id)
    assert job.status == "queued"
    (event,) = [e for e in stack.events(job_id) if "worker shutting down" in e.message]
    saved = event.data["step"]
    assert 2 <= saved < 500 and event.data["checkpoint_saved"] is True
    assert stop_checkpoint(stack, job_id).endswith(f"{saved:08d}")

    assert job_id in reconcile_once(stack.settings, redis=stack.redis, min_queued_age_s=0).reenqueued
    stack.worker()
    resumed = stack.wait_for(
        "the next attempt to resume",
        lambda: [e for e in stack.events(job_id) if e.data and e.data.get("resume_step") is not None],
    )
    assert resumed[0].data["resume_step"] == saved
    with stack.sessions() as s:
        assert jobstate.transition(s, job_id, "cancelling", expect=("running",), event="cancel requested")
    assert stack.wait_status(job_id, "cancelled", "failed", "succeeded", timeout=120).status == "cancelled"
    assert stack.job(job_id).attempt == 2


def test_offline_and_hybrid_jobs_fill_the_cache(
    stack: Stack, toy_verifier_dir: Path, toy_dataset_path: Path
) -> None:
    import json

    offline = stack.submit(toy_spec(toy_verifier_dir, toy_dataset_path, hidden_states={"mode": "offline"}))
    hybrid = stack.submit(
        toy_spec(
            toy_verifier_dir,
            toy_dataset_path,
            # Another storage dtype than the offline job's, so the hybrid job fills a cache of its own.
            hidden_states={"mode": "hybrid", "dtype": "fp32"},
            training={"epochs": 2, "max_steps": None, "checkpoint_every_steps": 1000},
        )
    )
    stack.run_burst(timeout=600)
    for job_id in (offline, hybrid):
        job = stack.job(job_id)
        assert job.status == "succeeded", job.error
        stages = [e.data["stage"] for e in stack.events(job_id) if e.type == "stage"]
        assert "hidden_states" in stages
        (cache_event,) = [
            e for e in stack.events(job_id) if e.data and e.data.get("stage") == "hidden_states"
        ][:1]
        # Events show server paths redacted to their last part: find that cache under the data dir.
        name = Path(cache_event.data["cache_dir"]).name
        (cache_dir,) = [
            p for p in Path(stack.settings.data_dir).rglob(name) if (p / "manifest.json").is_file()
        ]
        manifest = json.loads((cache_dir / "manifest.json").read_text())
        assert manifest["shards"], "the cache was filled"
    epochs = {m.get("epoch") for m in stack.metrics(hybrid) if "loss" in m}
    assert epochs == {0, 1}
    # The hybrid job ran the verifier in its first epoch only; the second read everything from the cache.
    first, second = [e.data for e in stack.events(hybrid) if e.data and e.data.get("kind") == "epoch"]
    assert (first["epoch"], second["epoch"]) == (0, 1)
    assert first["verifier_calls"] > 0 and first["cache_misses"] > 0
    assert second["verifier_calls"] == 0 and second["cache_misses"] == 0
    assert second["cache_hits"] > 0
    (ckpt,) = stack.checkpoints(hybrid)
    assert ckpt.metrics["verifier_calls"] == first["verifier_calls"]

    # The storage ledger holds every byte the jobs caused; deleting one frees what only it used.
    from sqlalchemy import select

    from service.crud.usage import storage_used
    from service.db.models import Job, StorageUsage
    from service.lifecycle import delete_job_with_files

    with stack.sessions() as s:
        rows = s.scalars(select(StorageUsage).where(StorageUsage.project_id == stack.project_id)).all()
        used = storage_used(s, stack.project_id)
    mine = {r.kind: r.key for r in rows if r.job_id == offline and r.bytes > 0}
    assert set(mine) >= {"prepared", "cache", "checkpoint", "training_checkpoint"}, rows
    shared = {r.key for r in rows if r.job_id == hybrid} & {mine["prepared"]}
    assert shared  # both jobs prepared the same data once
    store = ArtifactStore(stack.settings.artifact_root)
    assert used >= sum(store.size_under(key) for key in set(mine.values()))
    with stack.sessions() as s:
        assert delete_job_with_files(s, store, s.get(Job, offline))
        s.commit()
        assert storage_used(s, stack.project_id) < used
    assert not store.exists(mine["cache"]) and not store.exists(mine["checkpoint"])
    assert store.exists(mine["prepared"])  # the hybrid job still references it


def test_two_rank_job_runs_under_torchrun(
    stack: Stack, toy_verifier_dir: Path, toy_dataset_path: Path, tmp_path: Path
) -> None:
    # No GPUs here: the explicit opt-in runs the two ranks as CPU processes over gloo.
    stack.env.update(PEAGLE_ALLOW_CPU_MULTIPROCESS="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    spec = toy_spec(toy_verifier_dir, toy_dataset_path, resources={"gpus": 2}, evaluation={"prompts": 1})
    job_id = stack.submit(spec)
    stack.run_burst(timeout=600)
    job = stack.job(job_id)
    assert job.status == "succeeded", (job.error, [e.message for e in stack.events(job_id)])

    events = stack.events(job_id)
    ranks = sorted(e.data["rank"] for e in events if e.data and e.data.get("kind") == "rank")
    assert ranks == [0, 1]
    (train_event,) = [
        e for e in events if e.type == "stage" and e.message == "training" and "world_size" in e.data
    ]
    assert train_event.data["world_size"] == 2
    train_steps = sorted({m["step"] for m in stack.metrics(job_id) if "loss" in m})
    assert train_steps == [1, 2, 3, 4]  # rank 0 reports once per step, not once per rank

    (ckpt,) = stack.checkpoints(job_id)
    store = ArtifactStore(stack.settings.artifact_root)
    assert store.verify_files(ckpt.uri, ckpt.files) == []
    out = tmp_path / "download"
    store.fetch_dir(ckpt.uri, out)
    res = subprocess.run([*PEAGLE, "export", "validate", str(out)], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_more_gpus_than_the_worker_has_fails_clearly(
    stack: Stack, toy_verifier_dir: Path, toy_dataset_path: Path
) -> None:
    stack.env.update(CUDA_VISIBLE_DEVICES="")
    stack.env.pop("PEAGLE_ALLOW_CPU_MULTIPROCESS", None)
    job_id = stack.submit(toy_spec(toy_verifier_dir, toy_dataset_path, resources={"gpus": 2}))
    stack.run_burst()
    job = stack.job(job_id)
    assert job.status == "failed"
    assert job.error["code"] == "insufficient_gpus"
    assert job.error["param"] == "resources.gpus"
    assert "sees 0 GPU(s)" in job.error["message"]
    assert stack.checkpoints(job_id) == []


def test_worker_shutdown_checkpoints_and_requeues_a_two_rank_job(
    stack: Stack, toy_verifier_dir: Path, toy_dataset_path: Path
) -> None:
    """A drain reaches the torchrun ranks too: the horse forwards its signal, rank 0 saves a checkpoint and
    the job is handed back, as a single-process job is."""
    import signal

    stack.env.update(PEAGLE_ALLOW_CPU_MULTIPROCESS="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    spec = toy_spec(
        toy_verifier_dir,
        toy_dataset_path,
        resources={"gpus": 2},
        training={"max_steps": 500, "checkpoint_every_steps": 1000, "epochs": 50},
    )
    job_id = stack.submit(spec)
    worker = stack.worker()
    stack.wait_for(
        "training steps", lambda: (stack.job(job_id).progress or {}).get("step", 0) >= 2, timeout=400
    )
    worker.send_signal(signal.SIGTERM)  # what a supervisor or a node drain sends
    assert worker.wait(timeout=180) == 0
    stack.procs.remove(worker)

    job = stack.job(job_id)
    assert job.status == "queued", (job.error, [e.message for e in stack.events(job_id)])
    (event,) = [e for e in stack.events(job_id) if "worker shutting down" in e.message]
    saved = event.data["step"]
    assert 2 <= saved < 500 and event.data["checkpoint_saved"] is True
    assert stop_checkpoint(stack, job_id).endswith(f"{saved:08d}")
