"""GPU readiness suite: preflight, correctness on the device, and throughput at real scale, one JSON line
per check or figure, in one command that never needs editing on the device (issue 15).

    python bench/gpu_suite.py              # on a GPU machine; < 8 min; also writes $OUT/gpu_suite.jsonl
    python bench/gpu_suite.py --dry-run    # the same code with tiny shapes on the CPU (tests/bench)

Every stage runs under its own time cap (and the whole run under --budget-s); a stage whose needs the
preflight found missing is reported as skipped with the reason, and the rest still run. Throughput uses
random weights: a Llama-3.1-8B-shaped verifier built on the device in bf16, a 1-layer K=8 drafter with
COD 0.7/0.2, packed rows of 2048 and 8192 tokens. MFU divides model matmul FLOPs by a bf16 GEMM peak
measured in the same run. All training code is peagle_core's (builders, sources, `train_step`,
`evaluate`); this file only wires it up and times it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    drafter_step_flops,
    gemm_peak_flops,
    llama_forward_flops,
    peak_rss_mb,
)
from _suite import CheckFailed, Skip, Suite, tail

ROOT = Path(__file__).resolve().parents[1]
OUT_NAME = "gpu_suite.jsonl"
# Modules peagle_core needs beyond torch; a device image without one skips every check that uses it.
CORE_MODULES = ("pydantic", "transformers", "safetensors", "tokenizers", "yaml", "jinja2", "tqdm")
WHEELS_HINT = "carry the wheels bench/gpu_wheels.sh downloads (README, Benchmarks)"

# Llama-3.1-8B's shape (meta-llama/Llama-3.1-8B config.json); the weights are random.
LLAMA_31_8B: dict[str, Any] = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}
TINY_LLAMA: dict[str, Any] = {
    **LLAMA_31_8B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 1024,
}


@dataclass(frozen=True)
class Shapes:
    """Everything that differs between the device run and the CPU dry run."""

    verifier: dict[str, Any]
    seq_lens: tuple[int, ...]
    draft_vocab_size: int
    steps: int  # timed steps per throughput figure
    warmup: int  # untimed steps first (compilation)
    gemm_n: int
    overfit_steps: int
    lossless_prompts: int
    max_new_tokens: int
    num_layers: int = 1
    num_depths: int = 8
    down_sample_ratio: float = 0.7
    down_sample_ratio_min: float = 0.2


REAL = Shapes(
    LLAMA_31_8B,
    (2048, 8192),
    32000,
    steps=5,
    warmup=2,
    gemm_n=8192,
    overfit_steps=120,
    lossless_prompts=4,
    max_new_tokens=32,
)
DRY = Shapes(
    TINY_LLAMA,
    (64, 128),
    256,
    steps=2,
    warmup=1,
    gemm_n=256,
    overfit_steps=120,
    lossless_prompts=2,
    max_new_tokens=12,
)

# Per-stage caps, seconds (the run's deadline cuts them further). The sum exceeds the budget on purpose:
# most stages end well inside their cap, and the last ones are skipped ("out of time") if earlier ran long.
CAPS = {
    "preflight": 90,
    "gemm_peak": 30,
    "cuda_tests": 180,
    "overfit": 75,
    "lossless_eval": 45,
    "train_e2e": 60,
    "verifier_build": 60,
    "cache_build": 75,
    "cached_step": 75,  # the first one compiles FlexAttention for the real head size
    "cached_loader": 45,
    "online_step": 60,
    "hybrid_epoch": 50,
    "speculators_step": 120,  # its forward is torch.compile'd on CUDA
    "train_throughput": 150,  # bench/train_throughput.py at SmolLM2's shape: today's path, the new one, speculators
    "hidden_states_engines": 240,  # two vLLM starts (toy, SmolLM2 when carried) and the builds
    "real_model": 480,  # bench/real_model.py at a GPU's scale: regenerate, train, MT-Bench in vLLM and ours
    "vs_reference": 420,  # bench/vs_reference.py: ours and speculators' at equal tokens and time, in vLLM
    "scale": 120,  # bench/scale.py --quick: a torchrun launch per sharding and world size
}
OVERFIT_RATIO = 0.15  # the CPU dry run reaches ~0.09 in 120 steps at lr 1e-2


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _memory(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {"gpu_peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)}
    return {"rss_peak_mib": round(peak_rss_mb(), 1)}


# ------------------------------------------------------------------------------------------- preflight


def _module_found(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def preflight(suite: Suite, dry_run: bool) -> dict[str, Any]:
    """Versions, the device, and which pieces are importable; records capabilities for later stages."""
    info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__}
    info["torch_cuda"] = torch.version.cuda
    cuda = torch.cuda.is_available()
    info["cuda_available"] = cuda
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info.update(
            device_name=props.name,
            device_memory_gib=round(props.total_memory / 2**30, 1),
            compute_capability=f"{props.major}.{props.minor}",
            device_count=torch.cuda.device_count(),
        )
    if dry_run:
        suite.have("device", True)
    else:
        suite.have("device", cuda, "no CUDA device (use --dry-run for the CPU dry run)")

    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401

        flex = True
    except ImportError as exc:
        flex, info["flex_error"] = False, str(exc)
    info["flex_attention"] = flex
    info["triton"] = _version("triton")
    # FlexAttention is the CUDA attention path; the CPU (dry run) path is the chunked kernel.
    on_cuda = cuda and not dry_run
    if on_cuda and not (flex and info["triton"]):
        suite.have("attention", False, "FlexAttention or Triton is not importable with this torch")
    else:
        suite.have("attention", True)

    missing = [m for m in CORE_MODULES if not _module_found(m)]
    info["core_modules_missing"] = missing
    if missing:
        suite.have("peagle_core", False, f"missing {', '.join(missing)}: {WHEELS_HINT}")
    else:
        try:
            importlib.import_module("peagle_core.training.loop")
            suite.have("peagle_core", True)
        except Exception as exc:
            suite.have(
                "peagle_core", False, f"import peagle_core.training.loop failed: {type(exc).__name__}: {exc}"
            )
    info["peagle_core"] = suite.capabilities["peagle_core"].ok or suite.capabilities["peagle_core"].reason
    info["transformers"] = _version("transformers")
    info["pydantic"] = _version("pydantic")

    pytest_ok = _module_found("pytest")
    info["pytest"] = _version("pytest")
    suite.have("pytest", pytest_ok, "pytest is not installed")

    info["vllm"] = _vllm_probe(on_cuda)
    suite.have("vllm_cuda", info["vllm"].get("cuda_build") is True, info["vllm"].get("reason", ""))

    info["speculators"] = _version("speculators")
    if info["speculators"] is None:
        suite.have("speculators", False, f"speculators is not installed: {WHEELS_HINT}")
    else:
        try:
            importlib.import_module("speculators.models.peagle")
            suite.have("speculators", True)
        except Exception as exc:
            suite.have(
                "speculators", False, f"import speculators.models.peagle failed: {type(exc).__name__}: {exc}"
            )
    info["capabilities"] = {k: (v.ok or v.reason) for k, v in suite.capabilities.items()}
    return info


def _vllm_probe(on_cuda: bool) -> dict[str, Any]:
    """Whether the installed vLLM is a CUDA build that imports; its import runs in a child (10-30 s)."""
    version = _version("vllm")
    if version is None:
        return {"found": False, "reason": "vllm is not installed (the CUDA wheel is too large to carry)"}
    if not on_cuda:
        return {"found": True, "version": version, "cuda_build": False, "reason": "no CUDA device"}
    code = "import vllm, vllm.platforms as p; print(p.current_platform.device_type)"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=75)
    except subprocess.TimeoutExpired:
        return {"found": True, "version": version, "cuda_build": False, "reason": "import vllm took > 75 s"}
    if proc.returncode != 0:
        reason = f"import vllm failed: {tail(proc.stderr, 400)}"
        return {"found": True, "version": version, "cuda_build": False, "reason": reason}
    platform = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "?"
    return {
        "found": True,
        "version": version,
        "platform": platform,
        "cuda_build": platform == "cuda",
        "reason": "" if platform == "cuda" else f"vLLM platform is {platform!r}, not cuda",
    }


# ------------------------------------------------------------------------------------------- context


@dataclass
class Context:
    """What stages share: the device, shapes, scratch space, and what earlier stages built."""

    device: torch.device
    shapes: Shapes
    work: Path
    dry_run: bool
    toy_verifier_dir: Path | None = None
    peak_flops: float | None = None
    toy: dict[str, Any] = field(default_factory=dict)  # overfit drafter, toy dataset, val split
    verifier: Any = None  # the random-weight real-scale Verifier
    datasets: dict[int, Any] = field(default_factory=dict)  # seq_len -> PreparedDataset
    caches: dict[int, Path] = field(default_factory=dict)  # seq_len -> complete cache dir
    figures: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)  # for ratios

    @property
    def autocast(self) -> Any:
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else None

    def mfu(self, flops: float, seconds: float) -> float | None:
        if not self.peak_flops or seconds <= 0:
            return None
        return round(flops / seconds / self.peak_flops, 4)


# ------------------------------------------------------------------------------------------ correctness


def gemm_peak(ctx: Context) -> dict[str, Any]:
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    ctx.peak_flops = gemm_peak_flops(ctx.shapes.gemm_n, repeats=10, dtype=dtype, device=ctx.device)
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "n": ctx.shapes.gemm_n,
        "peak_tflops": round(ctx.peak_flops / 1e12, 2),
    }


def cuda_tests(ctx: Context, cap_s: float) -> dict[str, Any]:
    """The `cuda`-marked tests, in a child pytest; without CUDA only their collection is checked."""
    files = _cuda_test_files()
    if not files:
        raise CheckFailed("no test file under tests/ has a pytest.mark.cuda test")
    xml = ctx.work / "cuda-tests.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "cuda",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={xml}",
        *map(str, files),
    ]
    env = {**os.environ, "PEAGLE_CACHE_DIR": str(ctx.work), "PYTHONPATH": _pythonpath()}
    timeout = max(cap_s - 5, 5)
    if ctx.device.type != "cuda":
        proc = subprocess.run(
            [*cmd, "--collect-only"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        found = re.search(r"(\d+)(?:/\d+)? tests? collected", proc.stdout)
        if proc.returncode != 0 or not found or int(found[1]) == 0:
            raise CheckFailed("collecting the cuda tests failed", output=tail(proc.stdout + proc.stderr))
        raise Skip(f"no CUDA device; {found[1]} cuda tests collected", collected=int(found[1]))
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if not xml.is_file():
        raise CheckFailed("pytest wrote no report", output=tail(proc.stdout + proc.stderr))
    counts = _junit_counts(xml)
    if proc.returncode != 0 or counts["failures"] or counts["errors"] or counts["tests"] == 0:
        raise CheckFailed("cuda tests failed", **counts, output=tail(proc.stdout + proc.stderr, 4000))
    return counts


def _bench_child(script: str, args: list[str], cap_s: float, env: dict[str, str] | None = None) -> list[dict]:
    """Run bench/`script` in a child process within the stage's cap; its JSON lines."""
    cmd = [sys.executable, str(ROOT / "bench" / script), *args]
    env = {**os.environ, "PYTHONPATH": _pythonpath(), **(env or {})}
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(cap_s - 5, 5), check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise CheckFailed(f"bench/{script} ran past {cap_s:.0f} s") from exc
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise CheckFailed(
            f"bench/{script} {' '.join(args[:2])} failed", output=tail(proc.stdout + proc.stderr)
        )
    return lines


def hidden_states_engines(ctx: Context, cap_s: float) -> dict[str, Any]:
    """bench/hidden_states.py's engine column on the device: cache-build tokens/s and bytes/token with
    transformers vs vLLM (our KV connector), on the toy and on SmolLM2 when it is present; a child process,
    since vLLM takes the device for itself."""
    args = ["--only", "engines", "--size", "test", "--samples", "64", "--seq-len", "128",
            "--work", str(ctx.work / "hs-engines")]  # fmt: skip
    lines = _bench_child("hidden_states.py", args, cap_s, {"PEAGLE_CACHE_DIR": str(ctx.work)})
    figures: dict[str, Any] = {}
    for x in lines:
        figures[f"{x['verifier']}/{x['engine']}/{x['metric']}"] = round(float(x["value"]), 2)
    return {"figures": figures}


def scale(ctx: Context, cap_s: float) -> dict[str, Any]:
    """bench/scale.py --quick on the device's GPUs (nccl; one rank per GPU, at most 4): DDP vs FSDP step
    time, tokens/s, peak CUDA memory and DCP save/load time per rank. On the CPU the dry run skips it: the
    gloo figures come from running bench/scale.py by hand (a launch per configuration costs CI ~15 s)."""
    if ctx.device.type != "cuda":
        raise Skip("no CUDA device (bench/scale.py measures gloo on the CPU when run by hand)")
    ranks = [str(w) for w in (1, 2, 4) if w <= torch.cuda.device_count()]
    lines = _bench_child("scale.py", ["--quick", "--ranks", *ranks, "--work", str(ctx.work / "scale")], cap_s)
    return {"figures": lines}


def train_throughput(ctx: Context, cap_s: float) -> dict[str, Any]:
    """bench/train_throughput.py at SmolLM2's drafter shape in a child process: today's path (fp32, plain
    attention, eager loss) beside the new one and speculators'. The CPU dry run times two steps of the new
    path on a short row, its forward eager: it checks the bench runs (tests/core/training's
    test_compiled_forward checks the compiled forward), and compiling took 30 of its 54 s here."""
    if ctx.dry_run:
        args = ["--variants", "new", "--steps", "1", "--warmup", "1", "--seq-len", "512", "--compile", "off"]
    else:
        args = ["--steps", "10", "--warmup", "3"]
    lines = _bench_child("train_throughput.py", ["--shape", "smollm2", *args], cap_s)
    return {"figures": lines}


def real_model(ctx: Context, cap_s: float) -> dict[str, Any]:
    """bench/real_model.py, the headline figures (acceptance length in vLLM and ours on MT-Bench, vLLM's
    speed-up at batch 1 and 8), in a child process: it needs SmolLM2's wheel in pip's cache on the device."""
    args = ["--work", str(ctx.work / "real-model"), "--epochs", "4", "--repeats", "3"]
    lines = _bench_child("real_model.py", args, cap_s)
    return {"figures": [x for x in lines if x.get("stage") != "spec"]}


def vs_reference(ctx: Context, cap_s: float) -> dict[str, Any]:
    """bench/vs_reference.py's equal-tokens comparison at a small budget (our trainer against speculators
    0.9's P-EAGLE parts on the same SmolLM2 cache, both served by vLLM), in a child process."""
    args = ["--work", str(ctx.work / "vs-reference"), "--tokens", "2e5", "--seeds", "2", "--eval-prompts", "80",
            "--timing-prompts", "8", "--rounds", "2"]  # fmt: skip
    return {"figures": _bench_child("vs_reference.py", args, cap_s)}


def _cuda_test_files() -> list[Path]:
    """Test modules with a `cuda`-marked test (collecting only these keeps the child fast and free of
    the service tests' imports, which the device image lacks)."""
    return sorted(p for p in (ROOT / "tests").rglob("test_*.py") if "pytest.mark.cuda" in p.read_text())


def _junit_counts(path: Path) -> dict[str, Any]:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{case.get('classname')}.{case.get('name')}"
        for case in root.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return {**counts, "failed_tests": failed}


def _pythonpath() -> str:
    parts = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in parts if p)


def _toy(ctx: Context) -> tuple[Path, Path]:
    """The toy verifier directory and a 64-conversation JSONL of the toy corpus (each made once)."""
    from peagle_core.toy import build_toy_verifier, write_toy_dataset

    if ctx.toy_verifier_dir is None:
        # The same cache key and directory the pytest fixture uses under PEAGLE_CACHE_DIR: built once.
        ctx.toy_verifier_dir = build_toy_verifier("test", seed=0, cache_dir=ctx.work / "toy")
    data = ctx.work / "toy.jsonl"
    if not data.is_file():
        write_toy_dataset(data, n=64, seed=0)
    return ctx.toy_verifier_dir, data


def _toy_spec(
    verifier_dir: Path, data_path: Path, shapes: Shapes, mode: str = "online", **training: Any
) -> Any:
    from peagle_core.spec import parse_spec

    return parse_spec(
        {
            "verifier": {"name_or_path": str(verifier_dir)},
            "dataset": {"path": str(data_path), "seq_len": 128, "val_fraction": 0.1},
            "hidden_states": {"mode": mode},
            "model": {"num_layers": 1, "num_depths": 4, "draft_vocab_size": 256},
            "training": {"total_seq_len": 256, "seed": 0, **training},
            # Our evaluator only: vLLM's CUDA build is not on the device image, and on the CPU dry run an
            # engine start would eat the stage's time cap (tests/integration checks the vLLM path).
            "evaluation": {
                "prompts": shapes.lossless_prompts,
                "max_new_tokens": shapes.max_new_tokens,
                "engine": "peagle",
            },
            "export": {"vllm_check": False},
        }
    )


def _one_row(i: int) -> Any:
    """A one-rank step over one packed row: the `i`-th of its epoch (its COD draws follow `i`)."""
    from peagle_core.data.packing import StepShard

    return StepShard(bins=(i,), real=(True,), step_bins=1)


def make_trainer(
    spec: Any,
    verifier: Any,
    dataset: Any,
    source: Any,
    device: torch.device,
    out: Path,
    train_idx: list[int],
    total_steps: int,
) -> Any:
    """peagle_core's `Trainer` around an already-built verifier and source (what `train.setup` builds
    from a spec, minus loading the verifier from disk and resuming)."""
    from peagle_core.model.objective import Objective
    from peagle_core.training.builders import build_model, build_optimizer, build_teacher
    from peagle_core.training.checkpointer import Checkpointer
    from peagle_core.training.distributed import DistInfo
    from peagle_core.training.evaluator import Evaluator
    from peagle_core.training.loop import Hooks, Trainer
    from peagle_core.training.parallel import ParallelModel
    from peagle_core.training.publisher import Publisher
    from peagle_core.training.schedule import build_scheduler
    from peagle_core.training.training_data import TrainingData

    tc = spec.training
    hooks = Hooks(DistInfo())
    torch.manual_seed(tc.seed)
    model = build_model(spec, verifier, dataset, device)
    optimizer = build_optimizer(model, tc.lr, tc.weight_decay)
    scheduler = build_scheduler(optimizer, warmup_steps=0, total_steps=total_steps, min_lr_ratio=1.0)
    evaluator = Evaluator(spec, hooks, verifier, prompts=[])
    return Trainer(
        spec=spec,
        device=device,
        hooks=hooks,
        data=TrainingData(spec, dataset, train_idx, [], source),
        parallel=ParallelModel.single(model, device),
        teacher=build_teacher(verifier, model),
        objective=Objective(tc.depth_weights, tc.tv_weight),
        optimizer=optimizer,
        scheduler=scheduler,
        total_steps=total_steps,
        checkpointer=Checkpointer(
            out / "checkpoints", tc.checkpoint_every_steps, hooks, model, optimizer, scheduler
        ),
        evaluator=evaluator,
        publisher=Publisher(spec, out / "export", hooks, verifier.config, dataset.fingerprint, evaluator),
    )


def overfit(ctx: Context) -> dict[str, Any]:
    """Train the toy drafter on one packed batch until its loss collapses (bf16 autocast on CUDA)."""
    from peagle_core.data import prepare_dataset
    from peagle_core.hidden_states.backends import make_source
    from peagle_core.hidden_states.loader import BatchLoader
    from peagle_core.hidden_states.verifier import Verifier
    from peagle_core.training.builders import epoch_bins
    from peagle_core.training.loop import train_step

    verifier_dir, data = _toy(ctx)
    dataset = prepare_dataset(verifier_dir, data, ctx.work / "toy-data", seq_len=128, draft_vocab_size=256)
    spec = _toy_spec(verifier_dir, data, ctx.shapes, lr=1e-2, weight_decay=0.0, warmup_ratio=0.0)
    verifier = Verifier.load(str(verifier_dir), device=str(ctx.device))
    train_idx, val_idx = dataset.split(spec.dataset.val_fraction, spec.training.seed)
    source = make_source(
        "online",
        dataset,
        verifier_factory=lambda: verifier,
        pad_token_id=verifier.tokenizer.pad_token_id or 0,
    )
    run = make_trainer(
        spec, verifier, dataset, source, ctx.device, ctx.work / "toy-run", train_idx, ctx.shapes.overfit_steps
    )
    bins = epoch_bins(train_idx, list(dataset.lengths), spec, 0)
    with contextlib.closing(iter(BatchLoader(dataset, source, bins[:1], total_seq_len=256))) as it:
        batch = next(it).to(ctx.device)
    losses, metrics = [], {}
    for step in range(ctx.shapes.overfit_steps):
        metrics = train_step(run, iter([batch]), _one_row(step), epoch=0)
        losses.append(metrics["loss"])
    ctx.toy = {"model": run.model, "dataset": dataset, "val_idx": val_idx, "dir": verifier_dir}
    accs = {f"acc_{d}": round(metrics[f"acc_{d}"], 3) for d in range(run.model.config.num_depths)}
    fields = {
        "device": ctx.device.type,
        "verifier_dtype": str(verifier.dtype).removeprefix("torch."),
        "steps": len(losses),
        "tokens": batch.num_tokens,
        "first_loss": round(losses[0], 4),
        "last_loss": round(losses[-1], 4),
        **accs,
    }
    # Agreement with the toy teacher's argmax saturates below 1 (near-ties), so the loss is the criterion.
    if not all(map(_finite, losses)) or losses[-1] > OVERFIT_RATIO * losses[0]:
        raise CheckFailed(f"one batch did not overfit (want last loss <= {OVERFIT_RATIO} x first)", **fields)
    return fields


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def lossless_eval(ctx: Context) -> dict[str, Any]:
    """Greedy speculative decoding with the overfit drafter equals the verifier's own greedy output."""
    from peagle_core.evaluation.acceptance import evaluate, greedy_decode, held_out_prompts
    from peagle_core.hidden_states.verifier import Verifier

    if not ctx.toy:
        raise Skip("the overfit stage did not produce a drafter")
    # fp32 verifier: bf16 argmax ties could flip between a one-token and a K-token pass, which is
    # numerics, not the algorithm; the check is about the algorithm on the device.
    verifier = Verifier.load(str(ctx.toy["dir"]), device=str(ctx.device), dtype="float32")
    prompts = held_out_prompts(ctx.toy["dataset"], ctx.toy["val_idx"], limit=ctx.shapes.lossless_prompts)
    eos = verifier.tokenizer.eos_token_id
    k = ctx.toy["model"].config.num_depths
    result = evaluate(ctx.toy["model"], verifier, prompts, k, ctx.shapes.max_new_tokens, eos)
    mismatched = [
        i
        for i, (prompt, tokens) in enumerate(zip(prompts, result.tokens, strict=True))
        if greedy_decode(verifier, prompt, ctx.shapes.max_new_tokens, eos) != tokens
    ]
    fields = {
        "k": k,
        "prompts": len(prompts),
        "generated_tokens": result.num_generated_tokens,
        "acceptance_length": round(result.acceptance_length, 3),
        "mismatched_prompts": mismatched,
    }
    if not prompts or mismatched:
        raise CheckFailed("speculative output differs from plain greedy decoding", **fields)
    return fields


def train_e2e(ctx: Context) -> dict[str, Any]:
    """`peagle_core.pipeline.stages.run_pipeline` end to end on the toy, as a job runs it (hybrid hidden states, bf16
    autocast on CUDA, checkpoints, evaluation, the validated export), then resumed from its last
    checkpoint for two more steps."""
    from peagle_core.events import CallbackReporter
    from peagle_core.pipeline.stages import Callbacks, run_pipeline

    verifier_dir, data = _toy(ctx)
    out = ctx.work / "toy-train"
    shutil.rmtree(out, ignore_errors=True)
    losses: list[float] = []

    def record(metrics: dict[str, Any]) -> None:
        if "loss" in metrics:
            losses.append(metrics["loss"])

    spec = _toy_spec(verifier_dir, data, ctx.shapes, "hybrid", max_steps=4, checkpoint_every_steps=2)
    callbacks = Callbacks(reporter=CallbackReporter(metrics=record))
    first = run_pipeline(spec, out, callbacks=callbacks)
    spec.training.max_steps = 6
    second = run_pipeline(spec, out, callbacks=callbacks)
    fields = {
        "device": next(first.model.parameters()).device.type,
        "steps": [first.step, second.step],
        "results": [first.status, second.status],
        "losses": [round(x, 4) for x in losses],
        "acceptance_length": second.metrics.get(f"eval/acceptance_length@{spec.model.num_depths}"),
        "export": second.export_dir.name if second.export_dir else None,
    }
    ok = first.step == 4 and second.step == 6 and len(losses) == 6 and all(map(_finite, losses))
    if not ok or second.status != "completed" or second.export_dir is None:
        raise CheckFailed("training, resume or export went wrong", **fields)
    return fields


# ------------------------------------------------------------------------------------------ real scale


def build_verifier(ctx: Context) -> dict[str, Any]:
    """A random-weight Llama built directly on the device (bf16 on CUDA, fp32 on the CPU dry run)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from peagle_core.hidden_states.verifier import Verifier

    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    config = LlamaConfig(**ctx.shapes.verifier, tie_word_embeddings=False)
    _reset_peak(ctx.device)
    t0 = time.monotonic()
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    model.eval().requires_grad_(False)
    _sync(ctx.device)
    ctx.verifier = Verifier(model, None, f"random-llama-{config.num_hidden_layers}x{config.hidden_size}")
    params = sum(p.numel() for p in model.parameters())
    return {
        "params_b": round(params / 1e9, 3),
        "dtype": str(dtype).removeprefix("torch."),
        "layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "build_s": round(time.monotonic() - t0, 2),
        **_memory(ctx.device),
    }


def synthetic_dataset(path: Path, seq_len: int, n: int, vocab_size: int, draft_vocab_size: int) -> Any:
    """A PreparedDataset of `n` random-token samples of seq_len/4..seq_len/2 tokens (2..4 per packed row),
    the first 16 tokens of each a prompt (no loss); throughput does not depend on the token values."""
    from peagle_core.data.prepare import FORMAT_VERSION, PreparedDataset
    from peagle_core.data.vocab import build_draft_vocab, token_counts

    g = torch.Generator().manual_seed(seq_len)
    lengths = torch.randint(max(seq_len // 4, 18), seq_len // 2 + 1, (n,), generator=g)
    ids = [torch.randint(0, vocab_size - 1, (int(n_tok),), generator=g) for n_tok in lengths]
    masks = [torch.cat([torch.zeros(16), torch.ones(int(n_tok) - 16)]) for n_tok in lengths]
    input_ids, loss_mask = torch.cat(ids).to(torch.int32), torch.cat(masks).to(torch.uint8)
    offsets = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), lengths]), 0)
    d2t, t2d = build_draft_vocab(token_counts(input_ids, loss_mask, vocab_size), draft_vocab_size)
    fingerprint = hashlib.sha256(f"synthetic:{seq_len}:{n}:{vocab_size}".encode()).hexdigest()
    manifest = {
        "format_version": FORMAT_VERSION,
        "num_samples": n,
        "num_tokens": int(input_ids.numel()),
        "seq_len": seq_len,
        "fingerprint": fingerprint,
        "mask_token_id": vocab_size - 1,
        "draft_vocab_size": int(d2t.numel()),
        "verifier_vocab_size": vocab_size,
    }
    tokens = {"input_ids": input_ids, "loss_mask": loss_mask, "offsets": offsets}
    return PreparedDataset(path, manifest, tokens, {"d2t": d2t, "t2d": t2d})


def _real_spec(ctx: Context, seq_len: int, mode: str) -> Any:
    from peagle_core.spec import parse_spec

    s = ctx.shapes
    return parse_spec(
        {
            "verifier": {"name_or_path": ctx.verifier.name_or_path},
            "dataset": {"path": str(ctx.work / f"synthetic-{seq_len}"), "seq_len": seq_len},
            "hidden_states": {"mode": mode},
            "model": {
                "num_layers": s.num_layers,
                "num_depths": s.num_depths,
                "down_sample_ratio": s.down_sample_ratio,
                "down_sample_ratio_min": s.down_sample_ratio_min,
                "draft_vocab_size": s.draft_vocab_size,
            },
            "training": {"total_seq_len": seq_len, "lr": 1e-4, "warmup_ratio": 0.0, "seed": 0},
        }
    )


def _dataset(ctx: Context, seq_len: int) -> Any:
    if seq_len not in ctx.datasets:
        n = 4 * (ctx.shapes.warmup + ctx.shapes.steps)  # 2..4 samples per row: at least warmup + steps rows
        ctx.datasets[seq_len] = synthetic_dataset(
            ctx.work / f"synthetic-{seq_len}",
            seq_len,
            n,
            ctx.verifier.vocab_size,
            ctx.shapes.draft_vocab_size,
        )
    return ctx.datasets[seq_len]


def _fingerprint(ctx: Context, dataset: Any) -> Any:
    from peagle_core.hidden_states.cache import CacheFingerprint

    # Random weights: their name stands for them (hashing 16 GB of weights would take a minute).
    return CacheFingerprint(ctx.verifier.name_or_path, tuple(ctx.verifier.layer_ids), dataset.fingerprint)


def cache_build(ctx: Context, seq_len: int) -> dict[str, Any]:
    """Hidden-state cache build with the real-scale verifier: tokens/s end to end and of the forward."""
    from peagle_core.hidden_states.build import ComputeBackend, build_cache
    from peagle_core.hidden_states.loader import VerifierCompute

    dataset = _dataset(ctx, seq_len)
    compute = VerifierCompute(dataset, lambda: ctx.verifier, pad_token_id=0)
    forward_s = [0.0]

    def timed(indices: list[int]) -> Any:
        _sync(ctx.device)
        t0 = time.perf_counter()
        out = compute(indices)  # ends with a device-to-host copy, so it is synchronous
        forward_s[0] += time.perf_counter() - t0
        return out

    cache_dir = ctx.work / f"cache-{seq_len}"
    shutil.rmtree(cache_dir, ignore_errors=True)
    _reset_peak(ctx.device)
    t0 = time.perf_counter()
    report = build_cache(cache_dir, dataset, ComputeBackend(timed), _fingerprint(ctx, dataset), dtype="bf16")
    elapsed = time.perf_counter() - t0
    ctx.caches[seq_len] = cache_dir
    tokens = sum(dataset.lengths)
    flops = llama_forward_flops(ctx.verifier.config, list(dataset.lengths))
    return {
        "seq_len": seq_len,
        "samples": len(dataset),
        "tokens": tokens,
        "tokens_per_s": round(tokens / elapsed, 1),
        "forward_tokens_per_s": round(tokens / forward_s[0], 1),
        "cache_gib": round(report.total_bytes / 2**30, 3),
        "mfu": ctx.mfu(flops, elapsed),
        "forward_mfu": ctx.mfu(flops, forward_s[0]),
        **_memory(ctx.device),
    }


def _timed_steps(
    ctx: Context,
    run: Any,
    batches: Iterator[Any],
    count: int,
    seq_len: int,
    cap_end: float,
    verifier_lengths: Callable[[Any], list[int]] | None = None,
) -> dict[str, Any]:
    """Warm-up steps, then up to `count` timed `train_step`s (fewer if the soft cap `cap_end` nears)."""
    from peagle_core.training.loop import train_step

    cfg = run.model.config

    class Recorder:  # keeps what train_step consumed, for the token and FLOP counts
        last: Any = None

        def __iter__(self) -> Iterator[Any]:
            for b in batches:
                self.last = b
                yield b

    rec = Recorder()
    stream = iter(rec)
    for i in range(ctx.shapes.warmup):
        train_step(run, stream, _one_row(i), epoch=0)
    _reset_peak(ctx.device)
    elapsed, tokens, flops, steps, loss = 0.0, 0, 0, 0, None
    while steps < count and (steps == 0 or time.monotonic() < cap_end):
        _sync(ctx.device)
        t0 = time.perf_counter()
        metrics = train_step(run, stream, _one_row(steps), epoch=1)
        _sync(ctx.device)
        elapsed += time.perf_counter() - t0
        steps += 1
        positions = [int(metrics[f"positions_{d}"]) for d in range(cfg.num_depths)]
        flops += drafter_step_flops(cfg, seq_len, positions)
        if verifier_lengths is not None:
            flops += llama_forward_flops(ctx.verifier.config, verifier_lengths(rec.last))
        tokens += int(rec.last.num_tokens)
        loss = metrics["loss"]
    return {
        "seq_len": seq_len,
        "steps": steps,
        "tokens_per_s": round(tokens / elapsed, 1),
        "step_s": round(elapsed / steps, 4),
        "mfu": ctx.mfu(flops, elapsed),
        "model_tflops": round(flops / elapsed / 1e12, 3),
        "loss": round(loss, 4),
        **_memory(ctx.device),
    }


def _bins(ctx: Context, spec: Any, dataset: Any, epoch: int = 0) -> list[list[int]]:
    from peagle_core.training.builders import epoch_bins

    return epoch_bins(list(range(len(dataset))), list(dataset.lengths), spec, epoch)


def _offline_bins(ctx: Context, seq_len: int) -> tuple[Any, Any, Any, list[list[int]]]:
    """(dataset, spec, offline source, the rows to time) over the cache `cache_build` wrote."""
    from peagle_core.hidden_states.backends import make_source

    if seq_len not in ctx.caches:
        raise Skip(f"no complete cache for seq {seq_len} (cache_build@{seq_len} did not finish)")
    dataset = _dataset(ctx, seq_len)
    spec = _real_spec(ctx, seq_len, "offline")
    source = make_source(
        "offline",
        dataset,
        verifier_factory=lambda: ctx.verifier,
        cache_dir=ctx.caches[seq_len],
        fingerprint=_fingerprint(ctx, dataset),
    )
    return dataset, spec, source, _bins(ctx, spec, dataset)[: ctx.shapes.warmup + ctx.shapes.steps]


def _resident(ctx: Context, dataset: Any, source: Any, bins: list[list[int]], seq_len: int) -> list[Any]:
    from peagle_core.hidden_states.loader import BatchLoader

    with contextlib.closing(iter(BatchLoader(dataset, source, bins, total_seq_len=seq_len))) as it:
        return [b.to(ctx.device) for b in it]


def cached_step(ctx: Context, seq_len: int, cap_s: float) -> dict[str, Any]:
    """The training step from cached hidden states, on batches already on the device: the step alone."""
    end = time.monotonic() + 0.8 * cap_s  # stop timing here; the cap's alarm comes later
    dataset, spec, source, bins = _offline_bins(ctx, seq_len)
    run = make_trainer(spec, ctx.verifier, dataset, source, ctx.device, ctx.work / "run", [], 1000)
    batches = iter(_resident(ctx, dataset, source, bins, seq_len))
    step = _timed_steps(ctx, run, batches, ctx.shapes.steps, seq_len, end)
    ctx.figures[("cached_step", seq_len)] = step
    return {**step, "attention": _backend(run.model)}


def cached_loader(ctx: Context, seq_len: int, cap_s: float) -> dict[str, Any]:
    """The same step fed by the prefetching loader reading the cache, as an offline job runs it."""
    from peagle_core.hidden_states.loader import BatchLoader

    end = time.monotonic() + 0.8 * cap_s
    dataset, spec, source, bins = _offline_bins(ctx, seq_len)
    run = make_trainer(spec, ctx.verifier, dataset, source, ctx.device, ctx.work / "run", [], 1000)
    with contextlib.closing(iter(BatchLoader(dataset, source, bins, total_seq_len=seq_len))) as it:
        out = _timed_steps(ctx, run, it, ctx.shapes.steps, seq_len, end)
    step = ctx.figures.get(("cached_step", seq_len))
    return {**out, "of_resident": round(out["tokens_per_s"] / step["tokens_per_s"], 3) if step else None}


def _backend(model: Any) -> str:
    """The attention kernel the drafter runs: `auto` is FlexAttention on CUDA, the chunked kernel elsewhere."""
    if model.attention_backend != "auto":
        return model.attention_backend
    return "flex" if next(model.parameters()).is_cuda else "chunked"


def online_step(ctx: Context, seq_len: int, cap_s: float) -> dict[str, Any]:
    """Verifier forward (in the loader thread) + drafter step, as `hidden_states.mode: online` runs."""
    from peagle_core.hidden_states.backends import make_source
    from peagle_core.hidden_states.loader import BatchLoader

    end = time.monotonic() + 0.8 * cap_s
    dataset = _dataset(ctx, seq_len)
    spec = _real_spec(ctx, seq_len, "online")
    source = make_source("online", dataset, verifier_factory=lambda: ctx.verifier, pad_token_id=0)
    bins = _bins(ctx, spec, dataset)[: ctx.shapes.warmup + ctx.shapes.steps]
    run = make_trainer(spec, ctx.verifier, dataset, source, ctx.device, ctx.work / "run", [], 1000)
    with contextlib.closing(iter(BatchLoader(dataset, source, bins, total_seq_len=seq_len))) as it:
        out = _timed_steps(
            ctx,
            run,
            it,
            ctx.shapes.steps,
            seq_len,
            end,
            verifier_lengths=lambda b: [dataset.lengths[i] for i in b.sample_indices],
        )
    return {**out, "verifier_calls": source.counters()["verifier_calls"]}


def hybrid_epoch(ctx: Context, seq_len: int, cap_s: float) -> dict[str, Any]:
    """One epoch from an empty hybrid cache (every sample computed and written back), then a second
    epoch that reads it all back; tokens/s of each."""
    from peagle_core.hidden_states.backends import make_source
    from peagle_core.hidden_states.loader import BatchLoader
    from peagle_core.training.loop import train_step

    dataset = _dataset(ctx, seq_len)
    spec = _real_spec(ctx, seq_len, "hybrid")
    cache_dir = ctx.work / f"hybrid-{seq_len}"
    shutil.rmtree(cache_dir, ignore_errors=True)
    source = make_source(
        "hybrid",
        dataset,
        verifier_factory=lambda: ctx.verifier,
        cache_dir=cache_dir,
        fingerprint=_fingerprint(ctx, dataset),
        pad_token_id=0,
    )
    run = make_trainer(spec, ctx.verifier, dataset, source, ctx.device, ctx.work / "run", [], 1000)
    out: dict[str, Any] = {"seq_len": seq_len}
    _reset_peak(ctx.device)
    for epoch in (0, 1):
        bins = _bins(ctx, spec, dataset, epoch)
        before = source.counters()
        _sync(ctx.device)
        t0 = time.perf_counter()
        with contextlib.closing(iter(BatchLoader(dataset, source, bins, total_seq_len=seq_len))) as it:
            for i in range(len(bins)):
                train_step(run, it, _one_row(i), epoch=epoch)
        _sync(ctx.device)
        elapsed = time.perf_counter() - t0
        after = source.counters()
        tokens = sum(dataset.lengths[i] for b in bins for i in b)
        out[f"epoch{epoch}"] = {
            "steps": len(bins),
            "tokens_per_s": round(tokens / elapsed, 1),
            **{k: after[k] - before[k] for k in after},
        }
    out["cache_gib"] = round(source.stats()["cache_bytes"] / 2**30, 3)
    source.close()
    return {**out, **_memory(ctx.device)}


# ------------------------------------------------------------------------------------------ speculators


def speculators_model(ctx: Context, dataset: Any) -> Any:
    """speculators' P-EAGLE drafter of our drafter's shape, its verifier-derived weights copied from our
    random verifier (speculators reads them from disk; ours exist only on the device)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    s, verifier = ctx.shapes, ctx.verifier
    layer = LlamaConfig(**{**s.verifier, "num_hidden_layers": s.num_layers})
    # Its FlexAttention path on CUDA; on the CPU (dry run) FlexAttention has no backward, so SDPA.
    layer._attn_implementation = "simple_flex_attention" if ctx.device.type == "cuda" else "sdpa"
    proposal = GreedyTokenProposalConfig(speculative_tokens=s.num_depths)
    config = PEagleSpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=s.draft_vocab_size,
        norm_before_residual=True,
        eagle_aux_hidden_state_layer_ids=list(verifier.layer_ids),
        mask_token_id=dataset.mask_token_id,
        speculators_config=SpeculatorsConfig(
            algorithm="peagle",
            proposal_methods=[proposal],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier.name_or_path, architectures=["LlamaForCausalLM"]),
        ),
    )
    torch.manual_seed(0)
    model = PEagleDraftModel(config)
    model.load_vocab_mappings(dataset.t2d, dataset.d2t)
    with torch.no_grad():
        rows = verifier.lm_head_weight.detach()[dataset.t2d.to(verifier.device)].float().cpu()
        model.embed_tokens.weight.copy_(verifier.embed_weight.detach().float().cpu())
        model.lm_head.weight.copy_(rows)
        model.verifier_lm_head.weight.copy_(rows)
        model.verifier_norm.weight.copy_(verifier.final_norm.weight.detach().float().cpu())
    return model.to(ctx.device)


def speculators_step(ctx: Context, seq_len: int, cap_s: float) -> dict[str, Any]:
    """speculators' P-EAGLE training step (its trainer's: bf16 autocast, backward, clip, AdamW) on the
    same cached rows as `cached_step`, and its tokens/s as a ratio of ours."""
    from speculators.losses import resolve_loss_config
    from torch import _dynamo

    end = time.monotonic() + 0.8 * cap_s
    s = ctx.shapes
    dataset, _spec, source, bins = _offline_bins(ctx, seq_len)
    model = speculators_model(ctx, dataset).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    # Its default fused KL is a Triton kernel (CUDA only); the CPU dry run takes its eager twin.
    kwargs = {
        "num_depths": s.num_depths,
        "down_sample_ratio": s.down_sample_ratio,
        "down_sample_ratio_min": s.down_sample_ratio_min,
        "loss_config": resolve_loss_config("kl_div", "fused" if ctx.device.type == "cuda" else "eager"),
    }
    keys = (
        "hidden_states",
        "input_ids",
        "document_ids",
        "loss_mask",
        "position_ids",
        "verifier_last_hidden_states",
    )

    def step(batch: Any) -> float:
        # Its forward is torch.compile'd; compiling it shape-generic at once spares a second compile
        # when the next row samples another number of COD rows.
        with (
            _dynamo.config.patch(assume_static_by_default=False),
            ctx.autocast if ctx.autocast is not None else contextlib.nullcontext(),
        ):
            _, loss, _metrics = model(**{k: getattr(batch, k) for k in keys}, **kwargs)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return float(loss)

    batches = iter(_resident(ctx, dataset, source, bins, seq_len))
    for _ in range(s.warmup):
        step(next(batches))
    _reset_peak(ctx.device)
    elapsed, tokens, steps, last_loss = 0.0, 0, 0, float("nan")
    for batch in batches:
        if steps and time.monotonic() > end:
            break
        _sync(ctx.device)
        t0 = time.perf_counter()
        last_loss = step(batch)
        _sync(ctx.device)
        elapsed += time.perf_counter() - t0
        tokens, steps = tokens + batch.num_tokens, steps + 1
    ours = ctx.figures.get(("cached_step", seq_len))
    rate = tokens / elapsed
    return {
        "seq_len": seq_len,
        "steps": steps,
        "tokens_per_s": round(rate, 1),
        "step_s": round(elapsed / steps, 4),
        "loss": round(last_loss, 4),
        "attention": model.config.transformer_layer_config._attn_implementation,
        "note": "speculators keeps lm_head frozen; ours trains it",
        "ours_tokens_per_s": ours["tokens_per_s"] if ours else None,
        "ours_over_speculators": round(ours["tokens_per_s"] / rate, 3) if ours else None,
        **_memory(ctx.device),
    }


# ------------------------------------------------------------------------------------------------ main


def run_suite(args: argparse.Namespace) -> int:
    out_dir = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    suite = Suite(args.budget_s, out_dir / OUT_NAME if out_dir else None, only=args.only, time_caps=CAPS)
    work = Path(args.work or tempfile.mkdtemp(prefix="peagle-gpu-suite-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _run(suite, args, work)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


def _run(suite: Suite, args: argparse.Namespace, work: Path) -> int:
    dry = args.dry_run
    info = suite.stage("preflight", lambda _cap: preflight(suite, dry), always=True)
    if info is None:
        return suite.summary()
    device = torch.device("cpu" if dry or not torch.cuda.is_available() else "cuda")
    ctx = Context(device, DRY if dry else REAL, work, dry, args.toy_verifier)
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny tensors: more threads only contend on a shared CI machine
    # One process compiles FlexAttention for several configurations (toy and real head sizes, training
    # and inference, bf16 and fp32); past dynamo's recompile limit it would fall back to eager flex,
    # which materialises every score. Headroom, not a fix: a training job compiles one configuration.
    from torch import _dynamo

    knob = "recompile_limit" if hasattr(_dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(_dynamo.config, knob, max(getattr(_dynamo.config, knob), 32))
    core = ("device", "peagle_core", "attention")

    suite.stage("gemm_peak", lambda _cap: gemm_peak(ctx), needs=("device",), always=True)
    suite.stage("overfit", lambda _cap: overfit(ctx), needs=core)
    suite.stage("lossless_eval", lambda _cap: lossless_eval(ctx), needs=core)
    suite.stage("train_e2e", lambda _cap: train_e2e(ctx), needs=core)
    ctx.toy.clear()

    if suite.stage("verifier_build", lambda _cap: build_verifier(ctx), needs=core) is not None:
        suite.have("verifier", True)
    else:
        suite.have("verifier", False, "verifier_build did not finish")
    real = (*core, "verifier")
    for seq in ctx.shapes.seq_lens:
        suite.stage(f"cache_build@{seq}", lambda _cap, s=seq: cache_build(ctx, s), needs=real)
    for seq in ctx.shapes.seq_lens:
        suite.stage(f"cached_step@{seq}", lambda cap, s=seq: cached_step(ctx, s, cap), needs=real)
        suite.stage(f"cached_loader@{seq}", lambda cap, s=seq: cached_loader(ctx, s, cap), needs=real)
    for seq in ctx.shapes.seq_lens:
        suite.stage(f"online_step@{seq}", lambda cap, s=seq: online_step(ctx, s, cap), needs=real)
    suite.stage(
        f"hybrid_epoch@{ctx.shapes.seq_lens[0]}",
        lambda cap: hybrid_epoch(ctx, ctx.shapes.seq_lens[0], cap),
        needs=real,
    )
    for seq in ctx.shapes.seq_lens:
        suite.stage(
            f"speculators_step@{seq}",
            lambda cap, s=seq: speculators_step(ctx, s, cap),
            needs=(*real, "speculators"),
        )
    ctx.verifier = None
    suite.stage("train_throughput", lambda cap: train_throughput(ctx, cap), needs=("device", "peagle_core"))
    suite.stage(
        "hidden_states_engines",
        lambda cap: hidden_states_engines(ctx, cap),
        needs=("device", "peagle_core", "vllm_cuda"),
    )
    suite.stage("real_model", lambda cap: real_model(ctx, cap), needs=("device", "peagle_core", "vllm_cuda"))
    suite.stage(
        "vs_reference",
        lambda cap: vs_reference(ctx, cap),
        needs=("device", "peagle_core", "vllm_cuda", "speculators"),
    )
    suite.stage("scale", lambda cap: scale(ctx, cap), needs=("device", "peagle_core"))
    # Last: a child process of its own, so whatever time is left goes to it after every figure is in.
    suite.stage("cuda_tests", lambda cap: cuda_tests(ctx, cap), needs=("device", "peagle_core", "pytest"))
    return suite.summary()


def main(argv: Sequence[str] | None = None) -> int:
    # Progress bars and library chatter would push the JSON lines out of a short output tail.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (what CI runs)")
    parser.add_argument("--budget-s", type=float, default=450.0, help="deadline for the whole run, seconds")
    parser.add_argument("--out", type=Path, default=None, help=f"folder for {OUT_NAME} (default: $OUT)")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp dir)")
    parser.add_argument("--toy-verifier", type=Path, default=None, help="a built toy verifier to reuse")
    parser.add_argument(
        "--only",
        nargs="*",
        default=(),
        help="run only the stages whose names start so (preflight and gemm_peak always run); name the "
        "stages a check builds on too, e.g. --only verifier cache_build cached_step@2048",
    )
    return run_suite(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
