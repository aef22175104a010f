"""Hidden states from vLLM (`hidden_states.engine: vllm`) against the transformers engine, on the toy verifier.

One vLLM engine serves the module (equality, hybrid fill, online, resume); the kill test starts and kills
its own, and the refusal test starts one vLLM refuses. Tolerance, measured on this toy in fp32 on CPU: the
largest difference between the engines over all 64 samples is 7.2e-7 (aux layers) and 8.3e-7 (last
layer) on values of order 1 (fp32 kernels summing in another order). We allow 2e-5 absolute + 2e-5
relative: 25x the measured error, and still 200x below a bf16 rounding step (2^-8 relative), the
precision the cache stores by default, so no stored value can differ because of the engine.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from peagle_core.data.prepare import PreparedDataset
from peagle_core.hidden_states.backends import VllmBackend, make_source, plan_groups
from peagle_core.hidden_states.build import ComputeBackend, build_cache, verify_cache
from peagle_core.hidden_states.cache import CacheFingerprint, HiddenStateCache
from peagle_core.hidden_states.loader import BatchLoader, VerifierCompute
from peagle_core.hidden_states.vllm_extract import (
    HiddenStatesEngineError,
    VllmHiddenStates,
    VllmHiddenStatesConfig,
)
from peagle_core.vllm_engine import vllm_available
from tests.core.helpers import make_spec
from tests.fixtures.toy import TOY_SEQ_LEN

# One xdist worker runs the module: its vLLM engine and caches are module fixtures, built once per worker.
pytestmark = [
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
    pytest.mark.xdist_group("vllm_hidden_states"),
]

ATOL = RTOL = 2e-5
SHARD_BYTES = 1_500_000  # several fp32 shards for the 64-sample toy dataset


def _no_verifier():
    raise AssertionError("the vLLM engine must not load the transformers verifier")


@pytest.fixture(scope="module")
def ds(prepared_dataset: Path) -> PreparedDataset:
    return PreparedDataset.open(prepared_dataset)


@pytest.fixture(scope="module")
def fp(ds: PreparedDataset, toy_verifier) -> CacheFingerprint:
    return CacheFingerprint.of(toy_verifier, ds)


@pytest.fixture(scope="module")
def config(toy_verifier_dir: Path, toy_verifier) -> VllmHiddenStatesConfig:
    return VllmHiddenStatesConfig(
        str(toy_verifier_dir), tuple(toy_verifier.layer_ids), max_model_len=TOY_SEQ_LEN + 16
    )


@pytest.fixture(scope="module")
def engine(config: VllmHiddenStatesConfig):
    with VllmHiddenStates(config) as e:
        yield e


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory, ds, toy_verifier, fp) -> Path:
    out = tmp_path_factory.mktemp("hs") / "transformers"
    compute = VerifierCompute(ds, lambda: toy_verifier)
    build_cache(out, ds, ComputeBackend(compute), fp, dtype="fp32", shard_bytes=SHARD_BYTES)
    return out


@pytest.fixture(scope="module")
def vllm_cache(tmp_path_factory, ds, engine, fp) -> Path:
    out = tmp_path_factory.mktemp("hs") / "vllm"
    progress: list[tuple[int, int]] = []
    report = build_cache(
        out,
        ds,
        VllmBackend(engine),
        fp,
        dtype="fp32",
        shard_bytes=SHARD_BYTES,
        on_progress=lambda *a: progress.append(a),
    )
    assert report.computed == len(ds) and report.shards_written >= 3
    # The start, then the tokens done after each committed group, in order, up to the whole dataset.
    total = sum(int(ds[i][0].numel()) for i in range(len(ds)))
    assert progress[0] == (0, total) and progress[-1] == (total, total)
    assert len(progress) == report.shards_written + 1 and [d for d, _ in progress] == sorted(
        {d for d, _ in progress}
    )
    return out


def _assert_same_states(a, b) -> None:
    torch.testing.assert_close(a.aux, b.aux, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(a.last, b.last, atol=ATOL, rtol=RTOL)


def test_vllm_cache_equals_the_transformers_cache(ds, fp, hf_cache: Path, vllm_cache: Path) -> None:
    assert verify_cache(vllm_cache, ds) == []
    ours, ref = HiddenStateCache.open(vllm_cache, fp), HiddenStateCache.open(hf_cache, fp)
    assert ours.backend == "vllm" and ref.backend == "transformers"
    assert ours.is_complete() and ours.manifest["aux_dim"] == 3 * ours.manifest["last_dim"]
    worst = {"aux": 0.0, "last": 0.0}
    for i in range(len(ds)):
        a, b = ours.read(i, expected_ids=ds[i][0]), ref.read(i)
        _assert_same_states(a, b)
        worst["aux"] = max(worst["aux"], (a.aux - b.aux).abs().max().item())
        worst["last"] = max(worst["last"], (a.last - b.last).abs().max().item())
    print(json.dumps({"max_abs_diff": worst}))


def test_a_drafter_trains_the_same_from_either_engine(
    toy_verifier_dir, toy_dataset_path, prepared_dataset, hf_cache, vllm_cache, tmp_path
) -> None:
    from peagle_core.events import CallbackReporter
    from peagle_core.training.loop import train

    curves = {}
    for name, cache in (("transformers", hf_cache), ("vllm", vllm_cache)):
        # fp32 training: the two caches' rows differ by float rounding, which bf16 would magnify
        spec = make_spec(toy_verifier_dir, toy_dataset_path, mode="offline", max_steps=4, precision="fp32")
        spec.evaluation.prompts = 0
        metrics: list[dict] = []
        result = train(
            spec,
            tmp_path / name,
            dataset_dir=prepared_dataset,
            cache_dir=cache,
            reporter=CallbackReporter(metrics=metrics.append),
        )
        assert result.status == "completed"
        curves[name] = torch.tensor([m["loss"] for m in metrics if "loss" in m])
    assert len(curves["vllm"]) == 4
    torch.testing.assert_close(curves["vllm"], curves["transformers"], rtol=1e-4, atol=1e-5)


def test_hybrid_misses_are_filled_by_the_engine_that_built_the_cache(
    ds, fp, engine, hf_cache: Path, tmp_path: Path
) -> None:
    cache_dir = tmp_path / "hybrid"
    half = list(range(0, len(ds), 2))
    cache = HiddenStateCache.create(cache_dir, fp, dtype="fp32", num_dataset_samples=len(ds), backend="vllm")
    engine.fill(cache_dir, [(i, ds[i][0].tolist()) for i in half])
    # The spec says transformers; the cache was built by vLLM, so vLLM fills its misses.
    source = make_source(
        "hybrid",
        ds,
        backend="transformers",
        fingerprint=fp,
        verifier_factory=_no_verifier,
        vllm_factory=lambda: engine,
        cache_dir=cache_dir,
        dtype="fp32",
    )
    records = source.fetch(list(range(len(ds))))
    source.flush()
    assert source.counters() == {
        "verifier_calls": 1,
        "cache_hits": len(half),
        "cache_misses": len(ds) - len(half),
    }
    cache.refresh()
    assert cache.is_complete() and verify_cache(cache_dir, ds) == []
    ref = HiddenStateCache.open(hf_cache, fp)
    for i, rec in enumerate(records):
        _assert_same_states(rec, ref.read(i))


@pytest.mark.parametrize("keep", [False, True])
def test_online_batches_stream_from_vllm_and_are_deleted_unless_kept(
    ds, fp, engine, hf_cache: Path, tmp_path: Path, keep: bool
) -> None:
    cache_dir = tmp_path / "online"
    source = make_source(
        "online",
        ds,
        backend="vllm",
        fingerprint=fp,
        verifier_factory=_no_verifier,
        vllm_factory=lambda: engine,
        cache_dir=cache_dir,
        dtype="fp32",
        keep_online=keep,
    )
    bins = [list(range(k, k + 4)) for k in range(0, 16, 4)]
    before = set(Path(os.environ.get("TMPDIR", "/tmp")).glob("peagle-vllm-hs-*"))
    batches = list(BatchLoader(ds, source, bins, total_seq_len=4 * TOY_SEQ_LEN, prefetch=2))
    assert len(batches) == len(bins) and source.counters()["verifier_calls"] == len(bins)
    assert set(Path(os.environ.get("TMPDIR", "/tmp")).glob("peagle-vllm-hs-*")) == before  # scratch removed
    assert (cache_dir / "manifest.json").is_file() == keep
    if keep:
        kept = HiddenStateCache.open(cache_dir, fp)
        assert kept.indices() == list(range(16)) and kept.backend == "vllm"
    ref = HiddenStateCache.open(hf_cache, fp)
    for i, rec in enumerate(source.fetch(list(range(4)))):
        _assert_same_states(rec, ref.read(i))


def test_killed_vllm_fails_the_build_and_a_rerun_resumes_from_its_shards(
    ds, fp, config, engine, vllm_cache: Path, tmp_path: Path
) -> None:
    out = tmp_path / "killed"
    doomed = VllmHiddenStates(config)
    groups_done = []

    def kill_after_first(n: int) -> None:
        groups_done.append(n)
        os.kill(doomed.pids[0], signal.SIGKILL)

    try:
        with pytest.raises(HiddenStatesEngineError) as err:
            build_cache(
                out,
                ds,
                VllmBackend(doomed, on_group=kill_after_first),
                fp,
                dtype="fp32",
                shard_bytes=SHARD_BYTES,
            )
    finally:
        doomed.close()
    assert err.value.code == "hidden_states_engine_failed"
    assert "exited unexpectedly" in err.value.message and "-9" in err.value.message
    partial = HiddenStateCache.open(out, fp)
    assert len(partial.shards) == 1 and len(partial) == groups_done[0] < len(ds)
    assert verify_cache(out, ds) == []

    report = build_cache(out, ds, VllmBackend(engine), fp, dtype="fp32", shard_bytes=SHARD_BYTES)
    assert report.skipped == groups_done[0] and report.computed == len(ds) - groups_done[0]
    resumed, whole = HiddenStateCache.open(out, fp), HiddenStateCache.open(vllm_cache, fp)
    # Same shard cut, same batches: the resumed cache is byte for byte the uninterrupted one.
    assert {n: s["sha256"] for n, s in resumed.shards.items()} == {
        n: s["sha256"] for n, s in whole.shards.items()
    }


def test_a_verifier_vllm_refuses_fails_with_its_message(toy_verifier_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg = AutoConfig.from_pretrained(toy_verifier_dir)
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 4, 1, 16  # CPU attention rejects 16
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "v16")
    AutoTokenizer.from_pretrained(toy_verifier_dir).save_pretrained(tmp_path / "v16")
    with pytest.raises(HiddenStatesEngineError) as err:
        VllmHiddenStates(VllmHiddenStatesConfig(str(tmp_path / "v16"), (0, 1, 2), max_model_len=64)).start()
    assert err.value.code == "hidden_states_engine_failed"
    assert "head_dim=16" in err.value.message, err.value.message


def test_groups_cut_like_the_transformers_build(ds) -> None:
    groups = plan_groups(ds, list(range(len(ds))), 1028, SHARD_BYTES)
    assert [i for g in groups for i in g] == list(range(len(ds)))
    sizes = [sum(ds[i][0].numel() * 1028 for i in g) for g in groups]
    assert all(s >= SHARD_BYTES for s in sizes[:-1])
    assert all(s - ds[g[-1]][0].numel() * 1028 < SHARD_BYTES for s, g in zip(sizes, groups, strict=True))
    # resuming from any group boundary cuts the rest the same way
    assert plan_groups(ds, [i for g in groups[1:] for i in g], 1028, SHARD_BYTES) == groups[1:]
