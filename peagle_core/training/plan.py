"""Plan a job before it runs: counts after preparation, cache bytes, optimizer steps and per-stage wall time.

Wall times come from rates measured on this device: a short calibration (one regeneration batch, a few
verifier passes, a few real training steps ending in one evaluation), or the rates an earlier calibration
of the same setup stored (`Rates`, keyed by `rates_key`). The plan says which.
"""

from __future__ import annotations

import math
import os
import platform
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from peagle_core.keys import content_key
from peagle_core.serving.judge import resolve_evaluators
from peagle_core.spec import JobSpec

PLAN_VERSION = 1
CALIBRATION_STEPS = 5  # the first is warm-up; the other four time a step
CALIBRATION_PROMPTS = 6
CALIBRATION_SAMPLES = 8  # verifier passes timed for the hidden-state rate
REGEN_BATCH = 16  # conversations per generation batch (rewrite's BATCH_SIZE for transformers, which it times)
CACHE_DTYPES = ("bf16", "fp8", "fp32")


@dataclass
class Rates:
    """What one device does per unit of work for one setup (verifier, drafter shape, sequence lengths)."""

    device: str
    measured_at: str
    verifier_load_s: float
    hs_tokens_per_s: float  # verifier forward passes (hidden states)
    train_setup_s: float  # train() start to the first step: data, verifier, drafter, optimizer
    train_step_s: float  # one optimizer step with online hidden states
    train_tokens_per_step: float
    eval_s_per_pass: float  # speculative decoding: one verifier pass (drafting included)
    eval_tokens_per_prompt: float  # generated per prompt before EOS or max_new_tokens
    vllm_eval_s: float = 0.0  # one evaluation through vLLM's spec-decode counters (evaluation.engine)
    regen_s_per_batch: float | None = None  # one batch of REGEN_BATCH conversations
    regen_tokens_per_s: float | None = None
    # hidden_states.engine vllm: the engine's start and one replica's hidden-state rate
    vllm_hs_start_s: float | None = None
    vllm_hs_tokens_per_s: float | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Rates:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def device_name() -> str:
    """The device a worker trains on, as rates are keyed: the GPU's name, else the CPU and its core count."""
    import torch

    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(0)}"
    return f"cpu:{platform.machine()}:{os.cpu_count()}x:{torch.get_num_threads()}t"


def rates_key(spec: JobSpec, device: str) -> str:
    """What the rates depend on: the device, the verifier, the drafter's shape, lengths and regeneration."""
    blob = {
        "v": PLAN_VERSION,
        "device": device,
        "verifier": [spec.verifier.name_or_path, spec.verifier.revision, spec.verifier.dtype, spec.verifier.layer_ids],
        "model": spec.model.model_dump(mode="json"),
        "seq": [spec.dataset.seq_len, spec.training.total_seq_len, spec.training.grad_accum,
                spec.training.num_segments],
        "regenerate": spec.dataset.regenerate.model_dump() if spec.dataset.regenerate else None,
    }  # fmt: skip
    if spec.hidden_states.engine != "transformers":  # only then, so that stored transformers rates stay valid
        blob["hs_engine"] = [spec.hidden_states.engine, spec.resources.tensor_parallel_size]
    return content_key("plan_rates", blob)


# ------------------------------------------------------------------------------ calibration


def calibrate(spec: JobSpec, data_path: Path, dataset_dir: Path, work_dir: Path) -> Rates:
    """Measure this device's rates on the job's own verifier and data (a few seconds to minutes)."""
    import torch

    from peagle_core.data import PreparedDataset
    from peagle_core.hidden_states.verifier import Verifier

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dataset = PreparedDataset.open(dataset_dir)
    vllm_start_s = vllm_rate = None
    if spec.hidden_states.engine == "vllm":  # first: vLLM wants the device to itself while it runs
        vllm_start_s, vllm_rate = _vllm_hidden_state_rate(spec, dataset, work_dir / "vllm-calibration")
    t0 = time.perf_counter()
    verifier = Verifier.load(
        spec.verifier.name_or_path,
        revision=spec.verifier.revision,
        dtype=spec.verifier.dtype,
        device=device,
        layer_ids=spec.verifier.layer_ids,
        trust_remote_code=spec.verifier.trust_remote_code,
    )
    load_s = time.perf_counter() - t0
    hs_rate = _hidden_state_rate(verifier, dataset)
    regen_batch_s = regen_rate = None
    if spec.dataset.regenerate is not None:
        regen_batch_s, regen_rate = _regen_rate(spec, data_path, verifier)
    train_setup_s, step_s, tokens_per_step, eval_rate, eval_tokens, vllm_eval_s = _train_rates(
        spec, dataset_dir, work_dir, verifier
    )
    return Rates(
        device=device_name(),
        measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
        verifier_load_s=load_s,
        hs_tokens_per_s=hs_rate,
        train_setup_s=train_setup_s,
        train_step_s=step_s,
        train_tokens_per_step=tokens_per_step,
        eval_s_per_pass=eval_rate,
        eval_tokens_per_prompt=eval_tokens,
        vllm_eval_s=vllm_eval_s,
        regen_s_per_batch=regen_batch_s,
        regen_tokens_per_s=regen_rate,
        vllm_hs_start_s=vllm_start_s,
        vllm_hs_tokens_per_s=vllm_rate,
    )


def _vllm_hidden_state_rate(spec: JobSpec, dataset: Any, work: Path) -> tuple[float, float]:
    """Start one vLLM replica as the job would, and time a small cache build through it."""
    import dataclasses
    import shutil

    import torch
    from transformers import AutoConfig

    from peagle_core.hidden_states.backends import vllm_config_for
    from peagle_core.hidden_states.cache import CacheFingerprint, HiddenStateCache
    from peagle_core.hidden_states.vllm_extract import VllmHiddenStates
    from peagle_core.model.config import default_layer_ids

    layer_ids = spec.verifier.layer_ids
    if layer_ids is None:
        config = AutoConfig.from_pretrained(
            spec.verifier.name_or_path,
            revision=spec.verifier.revision,
            trust_remote_code=spec.verifier.trust_remote_code,
        )
        layer_ids = default_layer_ids(config.get_text_config().num_hidden_layers)
    config = vllm_config_for(spec, layer_ids, cuda=torch.cuda.is_available())
    config = dataclasses.replace(config, data_parallel_size=1)  # one replica's rate
    n = min(4 * CALIBRATION_SAMPLES, len(dataset))
    items = [(i, dataset[i][0].tolist()) for i in range(n)]
    shutil.rmtree(work, ignore_errors=True)
    HiddenStateCache.create(
        work, CacheFingerprint("calibration", tuple(layer_ids), "calibration"), engine="vllm"
    )
    with VllmHiddenStates(config) as engine:
        engine.fill(work, items[:1])  # warm-up
        t0 = time.perf_counter()
        engine.fill(work, items[1:] or items)
        seconds = time.perf_counter() - t0
        start_s = engine.start_seconds
    shutil.rmtree(work, ignore_errors=True)
    tokens = sum(len(ids) for _, ids in (items[1:] or items))
    return start_s, tokens / max(seconds, 1e-9)


def _hidden_state_rate(verifier: Any, dataset: Any) -> float:
    import torch

    n = min(CALIBRATION_SAMPLES, len(dataset))
    ids = [dataset[i][0] for i in range(n)]
    verifier.hidden_states(ids[0][None].to(verifier.device))  # warm-up
    t0 = time.perf_counter()
    for x in ids:
        verifier.hidden_states(x[None].to(verifier.device))
    if verifier.device.type == "cuda":
        torch.cuda.synchronize()
    return sum(len(x) for x in ids) / max(time.perf_counter() - t0, 1e-9)


def _regen_rate(spec: JobSpec, data_path: Path, verifier: Any) -> tuple[float, float]:
    """Seconds for one generation batch of the job's own conversations at its own settings."""
    from peagle_core.regeneration.generators import TransformersGenerator, stop_token_ids
    from peagle_core.regeneration.rewrite import _read_chat_rows, params_for_spec, rewrite_conversations

    params = params_for_spec(spec)
    _, rows = _read_chat_rows(data_path, params)
    stops = stop_token_ids(verifier.tokenizer, getattr(verifier.model, "generation_config", None))
    gen = TransformersGenerator(verifier.model, verifier.tokenizer, stops, temperature=params.temperature,
                                seed=params.seed, batch_size=REGEN_BATCH)  # fmt: skip
    batch = list(enumerate(rows[:REGEN_BATCH]))
    t0 = time.perf_counter()
    result = rewrite_conversations(batch, verifier.tokenizer, gen, params)
    seconds = time.perf_counter() - t0
    generated = result[1] if result is not None else 0
    # a smaller last batch costs about as much as a full one (it waits for its longest answer)
    return seconds, generated / max(seconds, 1e-9)


def _train_rates(spec: JobSpec, dataset_dir: Path, work_dir: Path, verifier: Any) -> tuple[float, ...]:
    """(setup s, s/step, tokens/step) from a few real training steps (with, when the job evaluates through
    vLLM too, the seconds of one such evaluation), then (eval s per verifier pass, eval tokens per prompt)
    from our speculative decoding of a few held-out prompts at the job's own length."""
    from peagle_core.data import PreparedDataset
    from peagle_core.evaluation.acceptance import evaluate, held_out_prompts
    from peagle_core.events import CallbackReporter, Event
    from peagle_core.training.loop import train

    calib = spec.model_copy(deep=True)
    calib.hidden_states.mode = "online"  # an offline job would build its whole cache first
    calib.training.max_steps = CALIBRATION_STEPS
    calib.training.epochs = max(calib.training.epochs, 1000)  # small data: keep stepping
    calib.training.eval_every_steps = None
    calib.training.checkpoint_every_steps = 10**6
    calib.export.vllm_check = False
    uses_vllm = resolve_evaluators(spec).vllm
    # our decoder is timed below, after a warm-up; vLLM's evaluation (its start-up included) is timed here
    calib.evaluation.prompts = CALIBRATION_PROMPTS if uses_vllm else 0
    if uses_vllm:
        calib.evaluation.engine = "vllm"
    stamps: list[tuple[float, float]] = []
    marks: dict[str, float] = {}

    def on_event(event: Event) -> None:
        if event.kind == "eval":
            marks.setdefault("eval", time.perf_counter())
        elif "eval" in marks:
            marks.setdefault("eval_end", time.perf_counter())

    def on_metrics(m: dict[str, Any]) -> None:
        if "loss" in m:
            stamps.append((time.perf_counter(), float(m.get("tokens_per_s") or 0.0)))

    t0 = time.perf_counter()
    result = train(calib, work_dir / "calibration", resume=False, dataset_dir=dataset_dir,
                   cache_dir=work_dir / "cache", reporter=CallbackReporter(events=on_event, metrics=on_metrics))  # fmt: skip
    vllm_eval_s = marks.get("eval_end", time.perf_counter()) - marks["eval"] if "eval" in marks else 0.0
    times = [t for t, _ in stamps]
    step_s = (times[-1] - times[0]) / max(1, len(times) - 1) if len(times) > 1 else times[0] - t0
    setup_s = max(0.0, times[0] - t0 - step_s)
    tokens_per_step = step_s * (sum(r for _, r in stamps[1:]) / max(1, len(stamps) - 1))

    dataset = PreparedDataset.open(dataset_dir)
    train_idx, val_idx = dataset.split(spec.dataset.val_fraction, spec.training.seed)
    prompts = held_out_prompts(dataset, val_idx or train_idx, limit=CALIBRATION_PROMPTS)
    eos = verifier.tokenizer.eos_token_id
    max_new = spec.evaluation.max_new_tokens
    evaluate(result.model, verifier, prompts[:1], spec.speculative_tokens[0], min(4, max_new), eos)  # warm-up
    passes = tokens = 0
    t0 = time.perf_counter()
    for k in spec.speculative_tokens:
        r = evaluate(result.model, verifier, prompts, k, max_new, eos)
        passes += r.verifier_passes + r.num_prompts  # each prompt's prefill is a verifier pass too
        tokens += r.num_generated_tokens
    eval_s = time.perf_counter() - t0
    n = max(1, len(prompts) * len(spec.speculative_tokens))
    return setup_s, step_s, tokens_per_step, eval_s / max(1, passes), tokens / n, vllm_eval_s


# ------------------------------------------------------------------------------ the plan


def plan_job(
    spec: JobSpec,
    data_path: str | Path,
    work_dir: str | Path,
    *,
    rates: Rates | None = None,
    free_bytes: int | None = None,
) -> tuple[dict[str, Any], Rates]:
    """The plan of `spec` on this device, and the rates it used (calibrated here unless `rates` is given)."""
    from peagle_core.data.prepare import prepare_for_spec
    from peagle_core.training.builders import count_steps

    data_path, work_dir = Path(data_path), Path(work_dir)
    _refuse_prompts_only(spec, data_path)
    t0 = time.perf_counter()
    dataset = prepare_for_spec(spec, data_path, work_dir / "prepared")
    prepare_s = time.perf_counter() - t0
    train_idx, val_idx = dataset.split(spec.dataset.val_fraction, spec.training.seed)
    steps = count_steps(spec, train_idx, dataset.lengths)

    source = "stored"
    if rates is None:
        rates = calibrate(spec, data_path, work_dir / "prepared", work_dir)
        source = "calibration"

    num_tokens = int(dataset.manifest["num_tokens"])
    cache = _cache_sizes(spec, num_tokens, free_bytes)
    stages = _stage_estimates(spec, rates, len(dataset), num_tokens, steps, val_idx)
    plan = {
        "plan_version": PLAN_VERSION,
        "estimates_from": source,
        "device": rates.device,
        "rates_measured_at": rates.measured_at,
        "counts": {
            "samples": len(dataset),
            "train_samples": len(train_idx),
            "val_samples": len(val_idx),
            "tokens": num_tokens,
            "loss_tokens": int(dataset.manifest["num_loss_tokens"]),
            "after": "regeneration changes answer lengths: counts are of the source answers"
            if spec.dataset.regenerate is not None
            else "preparation",
        },
        "cache": {
            "dtype": spec.hidden_states.dtype,
            "by_dtype": cache,
            "max_cache_bytes": spec.hidden_states.max_cache_bytes,
            "free_bytes": free_bytes,
        },
        "hidden_states_engine": spec.hidden_states.engine,
        "optimizer_steps": steps,
        "stages_s": stages,
        "total_s": round(sum(stages.values()) + prepare_s, 1),
        "prepare_s": round(prepare_s, 1),
        "rates": asdict(rates),
    }
    return plan, rates


def _cache_sizes(spec: JobSpec, num_tokens: int, free_bytes: int | None) -> dict[str, dict[str, Any]]:
    """The hidden-state cache's bytes in each dtype, and whether it fits the spec's limit and the free space."""
    from peagle_core.hidden_states.codec import bytes_per_token

    hidden = _verifier_hidden_size(spec)
    limit = spec.hidden_states.max_cache_bytes
    cache = {}
    for dtype in CACHE_DTYPES:
        size = num_tokens * bytes_per_token(dtype, 3 * hidden, hidden)
        cache[dtype] = {
            "bytes": size,
            "fits_max_cache_bytes": None if limit is None else size <= limit,
            "fits_free_space": None if free_bytes is None else size <= free_bytes,
        }
    return cache


def _refuse_prompts_only(spec: JobSpec, data_path: Path) -> None:
    """A plan counts the source's answers: prompts-only rows have none, so say so instead of failing later
    with "needs dataset.regenerate" on a spec that sets it."""
    from peagle_core.data.formats import iter_rows
    from peagle_core.errors import DataError

    if spec.dataset.regenerate is None or spec.dataset.format == "tokenized":
        return
    for _, row in iter_rows(data_path, spec.dataset.format, prompts_only_ok=True):
        if row.prompts_only:
            raise DataError(
                f"line {row.line}: no assistant turn: a plan counts the source's answers, so a prompts-only "
                "dataset cannot be planned yet; submit the job (regeneration writes the answers)",
                code="prompts_only_plan",
                param="dataset.regenerate",
            )


def _stage_estimates(
    spec: JobSpec, rates: Rates, num_samples: int, num_tokens: int, steps: int, val_idx: list[int]
) -> dict[str, float]:
    out: dict[str, float] = {}
    if spec.dataset.regenerate is not None and rates.regen_s_per_batch is not None:
        out["regenerate"] = (
            rates.verifier_load_s + math.ceil(num_samples / REGEN_BATCH) * rates.regen_s_per_batch
        )
    else:
        out["regenerate"] = 0.0
    mode = spec.hidden_states.mode
    verifier_share = min(rates.train_tokens_per_step / rates.hs_tokens_per_s, 0.8 * rates.train_step_s)
    offline_step = rates.train_step_s - verifier_share
    online_step, hs_start, hs_rate = rates.train_step_s, rates.verifier_load_s, rates.hs_tokens_per_s
    engine_start = 0.0
    if spec.hidden_states.engine == "vllm" and rates.vllm_hs_tokens_per_s:
        # vLLM's replicas compute side by side; online, each step waits for its batch's states
        hs_rate = rates.vllm_hs_tokens_per_s * spec.resources.data_parallel_size
        hs_start = engine_start = rates.vllm_hs_start_s or 0.0
        online_step = offline_step + rates.train_tokens_per_step / hs_rate
    # online and hybrid compute hidden states inside the training steps; offline builds the cache first
    out["hidden_states"] = hs_start + num_tokens / hs_rate if mode == "offline" else 0.0
    if mode == "online":
        step_s = online_step
    elif mode == "offline":
        step_s = offline_step
    else:  # hybrid: the first epoch computes, later ones read the cache
        step_s = (online_step + (spec.training.epochs - 1) * offline_step) / spec.training.epochs
    out["train"] = rates.train_setup_s + (engine_start if mode != "offline" else 0.0) + steps * step_s
    every = spec.training.eval_every_steps
    evals = 1 + ((steps - 1) // every if every else 0)
    prompts = spec.evaluation.prompts
    n_prompts = min(prompts, len(val_idx)) if isinstance(prompts, int) else len(prompts)
    # The trained drafter's acceptance length is unknown before training: assume sqrt(K + 1), the geometric
    # middle of its range [1, K + 1], so that no outcome is further than sqrt(K + 1)x from the estimate.
    tokens = rates.eval_tokens_per_prompt
    passes = sum(n_prompts * (1 + tokens / math.sqrt(k + 1)) for k in spec.speculative_tokens)
    evaluators = resolve_evaluators(spec)
    ours = passes * rates.eval_s_per_pass if evaluators.ours else 0.0
    out["eval"] = evals * (ours + (rates.vllm_eval_s if evaluators.vllm else 0.0))
    return {k: round(v, 1) for k, v in out.items()}


def _verifier_hidden_size(spec: JobSpec) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(
        spec.verifier.name_or_path,
        revision=spec.verifier.revision,
        trust_remote_code=spec.verifier.trust_remote_code,
    )
    return int(config.get_text_config().hidden_size)
