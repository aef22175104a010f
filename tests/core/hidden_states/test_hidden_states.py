"""Hidden-state sources with the real toy verifier and prepared data: offline, online, hybrid, BatchLoader, CLI."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from peagle_core.cli import build_app
from peagle_core.data.packing import pack_bins
from peagle_core.data.prepare import PreparedDataset
from peagle_core.hidden_states.backends import make_source
from peagle_core.hidden_states.build import ComputeBackend, build_cache, verify_cache
from peagle_core.hidden_states.cache import (
    CacheCorruptError,
    CacheError,
    CacheFingerprint,
    CacheMismatchError,
    CacheMissError,
    HiddenStateCache,
)
from peagle_core.hidden_states.codec import quantize
from peagle_core.hidden_states.loader import (
    BatchLoader,
    HybridSource,
    OfflineSource,
    OnlineSource,
    VerifierCompute,
)
from peagle_core.hidden_states.verifier import Verifier
from tests.fixtures.wait import wait_until

TOTAL_SEQ_LEN = 512


def _no_verifier():
    raise AssertionError("offline mode must not load the verifier")


@pytest.fixture(scope="module")
def ds(prepared_dataset: Path) -> PreparedDataset:
    return PreparedDataset.open(prepared_dataset)


@pytest.fixture(scope="module")
def fp(ds: PreparedDataset, toy_verifier: Verifier) -> CacheFingerprint:
    return CacheFingerprint.of(toy_verifier, ds)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, ds, toy_verifier, fp, prepared_dataset) -> Path:
    """A complete bf16 cache of the prepared toy dataset, several shards."""
    out = tmp_path_factory.mktemp("hs") / "cache"
    build_cache(
        out,
        ds,
        ComputeBackend(VerifierCompute(ds, lambda: toy_verifier)),
        fp,
        batch_size=16,
        shard_bytes=200_000,
        dataset_dir=str(prepared_dataset),
    )
    return out


def _copy(built: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(built, tmp_path / "cache"))


def _bins(ds: PreparedDataset, epoch: int) -> list[list[int]]:
    return pack_bins(ds.lengths, TOTAL_SEQ_LEN, seed=0, epoch=epoch)


def _epoch(ds, source, bins) -> list:
    return list(BatchLoader(ds, source, bins, total_seq_len=TOTAL_SEQ_LEN))


def test_online_batch_equals_single_sample_passes(ds, toy_verifier) -> None:
    idx = sorted(range(len(ds)), key=lambda i: ds.lengths[i])[:: len(ds) // 6][:6]
    assert len({ds.lengths[i] for i in idx}) > 1, "need samples of different lengths to exercise padding"
    src = OnlineSource(ds, lambda: toy_verifier)
    records = src.fetch(idx)
    assert src.verifier_calls == 1
    for i, rec in zip(idx, records, strict=True):
        aux, last = toy_verifier.hidden_states(ds[i][0][None])
        assert rec.aux.shape == (ds.lengths[i], 3 * toy_verifier.hidden_size)
        assert rec.aux.dtype == torch.float32 and rec.aux.device.type == "cpu"
        torch.testing.assert_close(rec.aux, aux[0].float(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(rec.last, last[0].float(), rtol=1e-4, atol=1e-4)


def test_offline_reads_what_online_computes(ds, toy_verifier, built, fp) -> None:
    src = make_source("offline", ds, verifier_factory=_no_verifier, cache_dir=built, fingerprint=fp)
    assert isinstance(src, OfflineSource)
    idx = [0, 7, len(ds) - 1]
    online = OnlineSource(ds, lambda: toy_verifier).fetch(idx)
    for got, want in zip(src.fetch(idx), online, strict=True):
        torch.testing.assert_close(got.aux, want.aux, rtol=2**-8, atol=1e-6)
        torch.testing.assert_close(got.last, want.last, rtol=2**-8, atol=1e-6)
    assert src.verifier_calls == 0


def test_cache_refuses_another_verifier_or_layers(ds, toy_verifier_dir, built, fp, tmp_path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    other_layers = Verifier.load(str(toy_verifier_dir), device="cpu", layer_ids=[1, 2, 3])
    assert list(other_layers.layer_ids) != list(fp.layer_ids)
    with pytest.raises(CacheMismatchError, match="other layer ids"):
        make_source(
            "offline",
            ds,
            verifier_factory=_no_verifier,
            cache_dir=built,
            fingerprint=CacheFingerprint.of(other_layers, ds),
        )
    # Another verifier: the same files but one weight (the fingerprint is the files' content).
    other_dir = tmp_path / "other-verifier"
    shutil.copytree(toy_verifier_dir, other_dir)
    (weights,) = other_dir.glob("*.safetensors")
    state = load_file(weights)
    name = next(iter(sorted(state)))
    state[name] = state[name] + 1e-3
    save_file(state, weights, metadata={"format": "pt"})
    other_weights = Verifier.load(str(other_dir), device="cpu")
    with pytest.raises(CacheMismatchError, match="another verifier"):
        # hybrid without a fingerprint derives it from the verifier it loads
        make_source("hybrid", ds, verifier_factory=lambda: other_weights, cache_dir=built)


def test_corrupt_shard_caught_by_verify_and_offline_and_repaired_by_hybrid(
    ds, toy_verifier, built, fp, tmp_path
) -> None:
    cache_dir = _copy(built, tmp_path)
    cache = HiddenStateCache.open(cache_dir, fp)
    victim_sample = len(ds) // 2
    victim = cache.shard_of(victim_sample)
    in_victim = [int(i) for i in cache.shards[victim]["samples"]]
    before = OfflineSource(ds, cache).fetch(in_victim)
    data = bytearray((cache_dir / victim).read_bytes())
    data[len(data) // 2 : len(data) // 2 + 8] = bytes(8)
    (cache_dir / victim).write_bytes(bytes(data))

    # the real CLI entry point: non-zero exit, the shard named
    proc = subprocess.run(
        [sys.executable, "-m", "peagle_core", "cache", "verify", str(cache_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert victim in proc.stderr and "sha256" in proc.stderr
    assert "Traceback" not in proc.stderr

    offline = make_source("offline", ds, verifier_factory=_no_verifier, cache_dir=cache_dir, fingerprint=fp)
    with pytest.raises(CacheCorruptError, match=victim):
        offline.fetch([victim_sample])

    hybrid = make_source(
        "hybrid", ds, verifier_factory=lambda: toy_verifier, cache_dir=cache_dir, fingerprint=fp
    )
    assert isinstance(hybrid, HybridSource)
    (rec,) = hybrid.fetch([victim_sample])
    hybrid.close()
    assert hybrid.repaired_shards == 1 and hybrid.verifier_calls >= 1
    assert verify_cache(cache_dir, ds) == []
    repaired = HiddenStateCache.open(cache_dir, fp)
    assert repaired.shard_of(victim_sample) == victim and repaired.shards[victim]["samples"] == in_victim
    assert len(repaired.shards) == len(cache.shards)
    after = OfflineSource(ds, repaired).fetch(in_victim)
    torch.testing.assert_close(rec.aux, after[in_victim.index(victim_sample)].aux)
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a.aux, b.aux, rtol=2**-7, atol=1e-5)
        torch.testing.assert_close(a.last, b.last, rtol=2**-7, atol=1e-5)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_hybrid_runs_the_verifier_only_in_the_first_epoch(ds, toy_verifier, fp, tmp_path, dtype) -> None:
    src = make_source(
        "hybrid",
        ds,
        verifier_factory=lambda: toy_verifier,
        cache_dir=tmp_path / "c",
        dtype=dtype,
        fingerprint=fp,
        shard_bytes=700_000,
    )
    bins1, bins2 = _bins(ds, 0), _bins(ds, 1)
    assert bins1 != bins2
    epoch1 = _epoch(ds, src, bins1)
    assert src.verifier_calls == len(bins1)  # one batched call per fetch group
    cache = HiddenStateCache.open(tmp_path / "c", fp)
    assert cache.is_complete() and cache.dtype == dtype
    # write-back batches samples into shards instead of one shard per fetch
    assert 1 < len(cache.shards) < len(bins1)
    epoch2 = _epoch(ds, src, bins2)
    assert src.verifier_calls == len(bins1)
    assert src.stats()["cache_hits"] == len(ds)

    # every epoch (and offline mode) sees the same stored values
    offline = make_source(
        "offline", ds, verifier_factory=_no_verifier, cache_dir=tmp_path / "c", fingerprint=fp
    )
    for batches, bins in ((epoch1, bins1), (epoch2, bins2)):
        for got, want in zip(batches, _epoch(ds, offline, bins), strict=True):
            assert got.sample_indices == want.sample_indices
            assert torch.equal(got.hidden_states, want.hidden_states)
            assert torch.equal(got.verifier_last_hidden_states, want.verifier_last_hidden_states)
            assert torch.equal(got.input_ids, want.input_ids)


def test_hybrid_honours_max_cache_bytes(ds, toy_verifier, built, fp, tmp_path) -> None:
    limit = HiddenStateCache.open(built).total_bytes // 3
    src = HybridSource(
        ds, tmp_path / "c", lambda: toy_verifier, fingerprint=fp, max_cache_bytes=limit, shard_bytes=50_000
    )
    bins = _bins(ds, 0)
    _epoch(ds, src, bins)
    first = src.verifier_calls
    cache = HiddenStateCache.open(tmp_path / "c", fp)
    assert 0 < cache.total_bytes <= limit
    assert src.uncached_samples == len(ds) - len(cache) > 0
    batches = _epoch(ds, src, bins)
    # uncached samples are still served (computed online) in later epochs, cached ones are read
    assert first < src.verifier_calls < 2 * first + 1
    assert sum(b.num_tokens for b in batches) == sum(n - 1 for n in ds.lengths)


def test_quantize_matches_what_the_cache_stores(ds, toy_verifier, built, fp) -> None:
    (online,) = OnlineSource(ds, lambda: toy_verifier).fetch([3])
    (stored,) = OfflineSource(ds, HiddenStateCache.open(built, fp)).fetch([3])
    q = quantize(online, "bf16")
    torch.testing.assert_close(q.aux, stored.aux, rtol=2**-8, atol=0)


class _RecordingSource(OfflineSource):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.fetched: list[list[int]] = []

    def fetch(self, indices):
        self.fetched.append(list(indices))
        return super().fetch(indices)


def test_batch_loader_prefetches_ahead_and_resumes_at_start(ds, built, fp) -> None:
    bins = _bins(ds, 0)
    src = _RecordingSource(ds, HiddenStateCache.open(built, fp))
    it = iter(BatchLoader(ds, src, bins, total_seq_len=TOTAL_SEQ_LEN, prefetch=2))
    first = next(it)
    # while the consumer holds batch 0, the thread keeps preparing batches 1 and 2
    wait_until(lambda: len(src.fetched) >= 3, message="batches 1 and 2 to be prefetched", interval=0.01)
    assert src.fetched[:3] == bins[:3]
    assert first.sample_indices == bins[0]
    it.close()

    loader = BatchLoader(
        ds, OfflineSource(ds, HiddenStateCache.open(built, fp)), bins, total_seq_len=TOTAL_SEQ_LEN, start=2
    )
    assert len(loader) == len(bins) - 2
    assert [b.sample_indices for b in loader] == bins[2:]


def test_batch_loader_raises_a_miss_from_its_thread(ds, toy_verifier, fp, tmp_path) -> None:
    with HybridSource(ds, tmp_path / "c", lambda: toy_verifier, fingerprint=fp) as partial:
        partial.fetch([0, 1, 2])
    offline = make_source(
        "offline", ds, verifier_factory=_no_verifier, cache_dir=tmp_path / "c", fingerprint=fp
    )
    bins = [[0, 1], [2, 3]]
    it = iter(BatchLoader(ds, offline, bins, total_seq_len=TOTAL_SEQ_LEN))
    assert next(it).sample_indices == [0, 1]
    with pytest.raises(CacheMissError, match="sample 3"):
        next(it)


def test_make_source_rejects_bad_modes(ds, tmp_path) -> None:
    with pytest.raises(CacheError, match=r"unknown hidden_states\.mode"):
        make_source("sometimes", ds, verifier_factory=_no_verifier, cache_dir=tmp_path)
    with pytest.raises(CacheError, match="needs a cache directory"):
        make_source("offline", ds, verifier_factory=_no_verifier)
    with pytest.raises(CacheMissError, match="no hidden-state cache"):
        make_source("offline", ds, verifier_factory=_no_verifier, cache_dir=tmp_path / "none")


def test_cli_build_is_resumable_and_verifies(toy_verifier_dir, prepared_dataset, built, tmp_path) -> None:
    runner = CliRunner()
    app = build_app()
    out = tmp_path / "cli"
    args = ["cache", "build", "--verifier", str(toy_verifier_dir), "--data", str(prepared_dataset)]
    args += ["--out", str(out), "--dtype", "fp8", "--shard-mb", "0.1", "--device", "cpu"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    n = len(PreparedDataset.open(prepared_dataset))
    assert f"{n} computed, 0 already cached" in res.output
    # The bar counts tokens, on stderr (stdout keeps the report); a finished build's rerun starts it full.
    assert "hidden states: 100%" in res.stderr and "token/s" in res.stderr, res.stderr
    assert "hidden states" not in res.stdout
    res = runner.invoke(app, args)
    assert res.exit_code == 0 and f"0 computed, {n} already cached" in res.output
    assert "hidden states: 100%" in res.stderr and "hidden states:   0%" not in res.stderr, res.stderr
    res = runner.invoke(app, ["cache", "verify", str(out)])
    assert res.exit_code == 0 and "ok" in res.output
    assert HiddenStateCache.open(out).total_bytes < 0.6 * HiddenStateCache.open(built).total_bytes
    res = runner.invoke(app, [*args[:8], "--dtype", "bf16", "--device", "cpu"])
    assert res.exit_code != 0 and "stores fp8, not bf16" in str(res.exception)
