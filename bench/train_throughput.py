"""Training throughput: tokens/s, MFU and peak RSS of full training steps (forward, backward, clip, AdamW).

Each variant runs in its own process (its peak RSS and allocator settings are its own), one JSON line each:

- `today`: the path before the hardware work: fp32, attention in plain PyTorch ops (`chunked`), eager
  loss kernels, multi-tensor AdamW, glibc's default allocator settings;
- `new`: what a job runs now: `training.precision: auto` (bf16 on a CPU with AMX-BF16 or AVX512-BF16),
  the fused flash-attention kernel, compiled loss kernels, the compiled drafter forward (`--compile`), fused
  AdamW, the allocator kept warm;
- `speculators`: speculators 0.9's P-EAGLE training step at the same shape (SDPA), in the precision `new`
  resolves to (bf16 autocast where bf16 is fast, fp32 elsewhere: emulated bf16 would only slow it down).

Shapes: `smollm2` is SmolLM2-135M's drafter (H 576, 9 query / 3 KV heads, intermediate 1536, vocabulary
49,152, draft vocabulary 8,192, 1 layer, K=4, COD 0.7 / 0.2) over 4,096 tokens packed as 8 documents of
512, on synthetic hidden states (a step's cost does not depend on their values); `toy` is the toy
verifier's drafter (H 256, 4 layers) on its cached hidden states. MFU divides the step's model FLOPs by
the measured GEMM peak of the precision the variant computes in.

    python bench/train_throughput.py --shape smollm2 --steps 6
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import drafter_step_flops, emit, gemm_peak_flops, peak_rss_mb, run_child

VARIANTS = ("today", "new", "speculators")
SMOLLM2 = {
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
}
SMOLLM2_DRAFTER = {"num_layers": 1, "num_depths": 4, "down_sample_ratio": 0.7, "down_sample_ratio_min": 0.2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2", choices=["smollm2", "toy"])
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compiles, warms caches)")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per packed row")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS)
    )
    parser.add_argument(
        "--data",
        default="synthetic",
        choices=["synthetic", "real", "both"],
        help="synthetic rows, real cached batches (the recipe's SmolLM2 data and hidden states; ours only), "
        "or both in one run",
    )
    parser.add_argument(
        "--real-work", type=Path, default=Path("bench-throughput-real"), help="real data, reused"
    )
    parser.add_argument(
        "--real-store", type=Path, help="a store with the data and cache already made (another bench's)"
    )
    parser.add_argument(
        "--real-tokens", type=float, help="the real data's token budget (default: enough for the timed steps)"
    )
    parser.add_argument("--num-depths", type=int, default=SMOLLM2_DRAFTER["num_depths"], help="K (smollm2)")
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"], help="ours' optimizer")
    parser.add_argument(
        "--compile",
        default="on",
        choices=["on", "off"],
        help="`new` trains through the compiled drafter forward, as a recipe-length job does "
        "(training.compile: auto); off: eager",
    )
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # a child's one variant
    parser.add_argument("--data-kind", default="synthetic", help=argparse.SUPPRESS)  # a child's data
    args = parser.parse_args()
    if args.variant:
        emit(**run_variant(args))
        return

    kinds = ["synthetic", "real"] if args.data == "both" else [args.data]
    if "real" in kinds:
        if args.shape != "smollm2":
            raise SystemExit("--data real runs at --shape smollm2 (the recipe's verifier)")
        prepare_real_data(args)
    results: dict[str, dict[str, Any]] = {}
    for variant in args.variants.split(","):
        for kind in kinds:
            if kind == "real" and variant == "speculators":
                continue  # its step is timed on the synthetic rows only
            child = [__file__, "--variant", variant, "--shape", args.shape, "--steps", str(args.steps),
                     "--warmup", str(args.warmup), "--seq-len", str(args.seq_len), "--data-kind", kind,
                     "--real-work", str(args.real_work), "--num-depths", str(args.num_depths),
                     "--optimizer", args.optimizer, "--real-tokens", str(args.real_tokens or 0),
                     "--compile", args.compile,
                     *(["--real-store", str(args.real_store)] if args.real_store else [])]  # fmt: skip
            env_note = {"PEAGLE_COMPILE": "0"} if variant == "today" else {}
            name = variant if kind == "synthetic" else f"{variant}/real"
            try:
                lines = _child(child, env_note)
            except Exception as exc:  # one variant failing (e.g. speculators missing) still reports the rest
                emit(metric="train_throughput", variant=name, shape=args.shape, error=str(exc)[-2000:])
                continue
            for line in lines:
                print(json.dumps(line), flush=True)
                results[name] = line
    if "new" in results and "new/real" in results:
        real_over = results["new/real"]["tokens_per_s"] / results["new"]["tokens_per_s"]
        emit(metric="train_throughput_ratio", shape=args.shape, real_over_synthetic=round(real_over, 3))
    if "today" in results and "new" in results:
        summary = {
            "new_over_today": round(results["new"]["tokens_per_s"] / results["today"]["tokens_per_s"], 3)
        }
        if "speculators" in results:
            summary["new_over_speculators"] = round(
                results["new"]["tokens_per_s"] / results["speculators"]["tokens_per_s"], 3
            )
            summary["rss_new_over_today"] = round(
                results["new"]["peak_rss_mb"] / results["today"]["peak_rss_mb"], 3
            )
        emit(metric="train_throughput_ratio", shape=args.shape, **summary)


def _child(args: list[str], env: dict[str, str]) -> list[dict[str, Any]]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return run_child(args, timeout=3600)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ------------------------------------------------------------------------------------------ one variant


def real_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe's job spec on enough of its data for the timed steps, at this run's K and row length."""
    from _prompts import sharegpt_by_tokens

    from peagle_core.recipes.material import verifier_dir
    from peagle_core.recipes.preset import load_recipe

    recipe = load_recipe()
    # Packing leaves some room in each row; a budget another bench used finds its data and cache.
    tokens = int(args.real_tokens or 1.3 * (args.steps + args.warmup) * args.seq_len)
    data = sharegpt_by_tokens(tokens, int(recipe.value("dataset.seq_len")))
    overrides = {"model.num_depths": args.num_depths, "training.total_seq_len": args.seq_len,
                 "training.max_steps": 1, "export.vllm_check": False}  # fmt: skip
    raw = recipe.job_spec(str(verifier_dir(recipe)), dataset_path=str(data), overrides=overrides)
    raw["evaluation"] = {"prompts": 0}
    return raw


def prepare_real_data(args: argparse.Namespace) -> None:
    """The real data and its hidden-state cache, made once through the job's pipeline (one training step)."""
    from _real_data import prepared_pipeline

    raw = real_spec(args)
    prepared_pipeline(raw, args.real_work / "run", _real_store(args))
    (args.real_work / "spec.json").write_text(json.dumps(raw))


def _real_store(args: argparse.Namespace) -> Path:
    return args.real_store or args.real_work / "store"


def _real_setup(args: argparse.Namespace, device: torch.device) -> tuple[Any, Any, Any]:
    """Our drafter for the real data (its vocabulary map), the verifier's teacher, and the cached batches
    read ahead of the timing (the loader's own time is reported apart: `loader_s_per_batch`)."""
    from _real_data import RealData

    from peagle_core.pipeline.stages import LocalStore, Pipeline
    from peagle_core.spec import parse_spec
    from peagle_core.training.builders import build_teacher

    spec = parse_spec(json.loads((args.real_work / "spec.json").read_text()))
    pipeline = Pipeline.of(spec, args.real_work / "run", store=LocalStore(_real_store(args)))
    data = RealData.of(pipeline, device)
    model = data.drafter(device).train()
    teacher = build_teacher(data.verifier, model)
    t0 = time.perf_counter()
    batches = [b.to(device) for b in data.batches(args.steps + args.warmup)]
    args.loader_s_per_batch = (time.perf_counter() - t0) / len(batches)
    del data.verifier.model  # only its final norm and head rows (the teacher) are needed from here
    return model, teacher, lambda i: batches[i]


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.variant == "speculators":
        from peagle_core.model.precision import resolve_precision

        precision = resolve_precision("auto", device)
        step, cfg, batches = _speculators_setup(args, device, precision)
    else:
        step, cfg, batches, precision = _ours_setup(args, device)
    elapsed = tokens = flops = 0.0
    for i in range(args.steps + args.warmup):
        batch = batches(i)
        _sync(device)
        t0 = time.perf_counter()
        positions = step(batch, i)
        _sync(device)
        if i < args.warmup:
            continue
        elapsed += time.perf_counter() - t0
        tokens += batch.num_tokens
        flops += drafter_step_flops(cfg, args.seq_len, positions)
    peak = gemm_peak_flops(dtype=torch.bfloat16 if precision == "bf16" else torch.float32, device=device)
    achieved = flops / elapsed
    return {
        "metric": "train_throughput",
        "variant": args.variant if args.data_kind == "synthetic" else f"{args.variant}/real",
        "data": args.data_kind,
        "optimizer": args.optimizer if args.variant != "speculators" else "adamw",
        "compiled_forward": getattr(args, "compiled_forward", False),
        **({"loader_s_per_batch": round(args.loader_s_per_batch, 3)} if args.data_kind == "real" else {}),
        "shape": args.shape,
        "device": device.type,
        "precision": precision,
        "hidden_size": cfg.hidden_size,
        "num_layers": cfg.num_layers,
        "num_depths": cfg.num_depths,
        "draft_vocab_size": cfg.draft_vocab_size,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "tokens_per_s": round(tokens / elapsed, 1),
        "step_s": round(elapsed / args.steps, 4),
        "model_tflops": round(achieved / 1e12, 4),
        "peak_tflops": round(peak / 1e12, 4),
        "mfu": round(achieved / peak, 4),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "threads": torch.get_num_threads(),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ours_setup(args: argparse.Namespace, device: torch.device) -> tuple[Any, Any, Any, str]:
    from peagle_core.model.precision import autocast_for, resolve_precision
    from peagle_core.training.builders import build_optimizer
    from peagle_core.training.compiled_forward import CompiledForward, should_compile
    from peagle_core.training.cpu_runtime import keep_freed_memory
    from peagle_core.training.loop import forward_backward

    new = args.variant == "new"
    if args.data_kind == "real":
        model, teacher, batches = _real_setup(args, device)
    elif args.shape == "smollm2":
        model, teacher, batches = _smollm2_ours(args, device)
    else:
        model, teacher, batches = _toy_ours(args, device)
    model.attention_backend = "auto" if new else "chunked"
    precision = resolve_precision("auto", device) if new else "fp32"
    if new and device.type == "cpu":
        keep_freed_memory()
    optimizer = build_optimizer(model, 1e-4, 0.01, args.optimizer)
    if not new and args.optimizer == "adamw":  # the multi-tensor AdamW the trainer used before
        optimizer = torch.optim.AdamW(optimizer.param_groups, lr=1e-4, betas=(0.9, 0.95), fused=False)
    autocast = autocast_for(precision, device)
    depths = model.config.num_depths
    compiled = new and should_compile(args.compile, device, False, model.config.method, args.steps)
    step_module = CompiledForward(model) if compiled else model
    args.compiled_forward = compiled

    def step(batch: Any, i: int) -> list[int]:
        metrics = forward_backward(
            step_module,
            teacher,
            batch,
            num_segments=1,
            generator=torch.Generator().manual_seed(i),
            scale=1.0,
            autocast=autocast if precision == "bf16" else None,
        )
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return [int(metrics[f"positions_{d}"]) for d in range(depths)]

    return step, model.config, batches, precision


def _smollm2_batch(seq_len: int, hidden: int, vocab: int, device: torch.device) -> Any:
    from peagle_core.data.packing import PackedBatch

    g = torch.Generator().manual_seed(0)
    doc_len = 512
    docs = torch.arange(seq_len) // doc_len
    return PackedBatch(
        input_ids=torch.randint(1, vocab, (1, seq_len), generator=g),
        loss_mask=torch.ones(1, seq_len, dtype=torch.long),
        document_ids=docs[None],
        position_ids=(torch.arange(seq_len) % doc_len)[None],
        hidden_states=torch.randn(1, seq_len, 3 * hidden, generator=g),
        verifier_last_hidden_states=torch.randn(1, seq_len, hidden, generator=g),
        num_tokens=seq_len,
        num_loss_tokens=seq_len,
        sample_indices=[],
    ).to(device)


def _smollm2_ours(args: argparse.Namespace, device: torch.device) -> tuple[Any, Any, Any]:
    from peagle_core.model.config import PEagleConfig
    from peagle_core.model.drafter import PEagleDraftModel
    from peagle_core.model.objective import Teacher

    torch.manual_seed(0)
    drafter = {**SMOLLM2_DRAFTER, "num_depths": args.num_depths}
    cfg = PEagleConfig(**SMOLLM2, **drafter, draft_vocab_size=8192, mask_token_id=0)
    model = PEagleDraftModel(cfg).to(device).train()
    h = cfg.hidden_size
    teacher = Teacher(torch.ones(h), cfg.rms_norm_eps, 0.05 * torch.randn(cfg.draft_vocab_size, h)).to(device)
    batch = _smollm2_batch(args.seq_len, h, cfg.vocab_size, device)
    return model, teacher, lambda _i: batch


def _toy_ours(args: argparse.Namespace, device: torch.device) -> tuple[Any, Any, Any]:
    from peagle_core.data import prepare_dataset
    from peagle_core.data.packing import pack_bins
    from peagle_core.hidden_states.backends import make_source
    from peagle_core.hidden_states.build import ComputeBackend, build_cache
    from peagle_core.hidden_states.cache import CacheFingerprint
    from peagle_core.hidden_states.loader import BatchLoader, VerifierCompute
    from peagle_core.hidden_states.verifier import Verifier
    from peagle_core.spec import parse_spec
    from peagle_core.toy import build_toy_verifier, write_toy_dataset
    from peagle_core.training.builders import build_model, build_teacher

    work = Path(tempfile.mkdtemp(prefix="peagle-throughput-"))
    verifier_dir = build_toy_verifier("default")
    data = write_toy_dataset(work / "corpus.jsonl", n=400)
    seq = min(args.seq_len, 1024)
    dataset = prepare_dataset(verifier_dir, data, work / "data", seq_len=seq)
    verifier = Verifier.load(str(verifier_dir), device="cpu")
    fingerprint = CacheFingerprint.of(verifier, dataset)
    build_cache(
        work / "cache",
        dataset,
        ComputeBackend(VerifierCompute(dataset, lambda: verifier)),
        fingerprint,
        dtype="bf16",
    )
    source = make_source("offline", dataset, verifier_factory=lambda: verifier, cache_dir=work / "cache",
                         fingerprint=fingerprint)  # fmt: skip
    spec = parse_spec(
        {
            "verifier": {"name_or_path": str(verifier_dir)},
            "dataset": {"path": str(data), "seq_len": seq},
            "model": {"num_layers": 4, "num_depths": 4, "draft_vocab_size": None},
            "training": {"total_seq_len": args.seq_len},
        }
    )
    torch.manual_seed(0)
    model = build_model(spec, verifier, dataset, device).train()
    teacher = build_teacher(verifier, model)
    bins: list[list[int]] = []
    epoch = 0
    while len(bins) < args.steps + args.warmup:
        bins += pack_bins(dataset.lengths, args.seq_len, seed=0, epoch=epoch)
        epoch += 1
    batches = [b.to(device) for b in BatchLoader(dataset, source, bins[: args.steps + args.warmup],
                                                 total_seq_len=args.seq_len)]  # fmt: skip
    return model, teacher, lambda i: batches[i]


def _speculators_setup(
    args: argparse.Namespace, device: torch.device, precision: str
) -> tuple[Any, Any, Any]:
    """speculators' PEagleDraftModel at the SmolLM2 shape, its trainer's step (autocast when `precision` is
    bf16, backward, clip, AdamW over its trainable parameters; it keeps the lm_head frozen)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses import resolve_loss_config
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from torch import _dynamo
    from transformers import LlamaConfig

    from peagle_core.model.config import PEagleConfig

    if args.shape != "smollm2":
        raise SystemExit("the speculators variant runs at --shape smollm2")
    drafter = {**SMOLLM2_DRAFTER, "num_depths": args.num_depths}
    cfg = PEagleConfig(**SMOLLM2, **drafter, draft_vocab_size=8192, mask_token_id=0)
    layer = LlamaConfig(**cfg.to_llama_config().to_dict())
    layer._attn_implementation = "simple_flex_attention" if device.type == "cuda" else "sdpa"
    config = PEagleSpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=cfg.draft_vocab_size,
        norm_before_residual=True,
        eagle_aux_hidden_state_layer_ids=[2, 15, 27],
        mask_token_id=0,
        speculators_config=SpeculatorsConfig(
            algorithm="peagle",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=cfg.num_depths)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path="smollm2-shape", architectures=["LlamaForCausalLM"]),
        ),
    )
    torch.manual_seed(0)
    model = PEagleDraftModel(config)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[: cfg.draft_vocab_size] = True
    model.load_vocab_mappings(t2d, torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
    model = model.to(device).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    kwargs = {
        "num_depths": cfg.num_depths,
        "down_sample_ratio": cfg.down_sample_ratio,
        "down_sample_ratio_min": cfg.down_sample_ratio_min,
        "loss_config": resolve_loss_config("kl_div", "fused" if device.type == "cuda" else "eager"),
    }
    keys = ("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids",
            "verifier_last_hidden_states")  # fmt: skip
    batch = _smollm2_batch(args.seq_len, cfg.hidden_size, cfg.vocab_size, device)
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    )

    def step(b: Any, _i: int) -> list[int]:
        with _dynamo.config.patch(assume_static_by_default=False), autocast:
            _, loss, _metrics = model(**{k: getattr(b, k) for k in keys}, **kwargs)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        # FLOPs are counted on our rows' expectation: the same COD ratios over the same tokens.
        return _expected_positions(args.seq_len, cfg)

    return step, cfg, lambda _i: batch


def _expected_positions(seq_len: int, cfg: Any) -> list[int]:
    out, ratio = [], 1.0
    for _ in range(cfg.num_depths):
        out.append(int(seq_len * ratio))
        ratio = max(ratio * cfg.down_sample_ratio, cfg.down_sample_ratio_min)
    return out


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
