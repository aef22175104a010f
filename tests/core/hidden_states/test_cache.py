"""The hidden-state cache: codecs, fingerprint refusal, checksums/verify, resumable and crash-safe builds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from peagle_core.hidden_states.build import ComputeBackend, build_cache, verify_cache
from peagle_core.hidden_states.cache import (
    CacheCorruptError,
    CacheFingerprint,
    CacheMismatchError,
    CacheMissError,
    HiddenStateCache,
)
from peagle_core.hidden_states.codec import HiddenRecord, decode_rows, encode_rows

AUX, LAST = 48, 16


class SyntheticTokens:
    """A stand-in for the prepared dataset's token view: deterministic ids of varied lengths."""

    fingerprint = "synthetic-data-v1"

    def __init__(self, n: int = 40, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(5, 40, (n,), generator=g).tolist()
        self.ids = [torch.randint(0, 500, (k,), generator=g) for k in lengths]
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[i], torch.ones_like(self.ids[i])


def synthetic_compute(ds: SyntheticTokens):
    """Deterministic per-sample hidden states (so a rebuild reproduces them bit for bit)."""

    def compute(indices: list[int]) -> list[HiddenRecord]:
        out = []
        for i in indices:
            g = torch.Generator().manual_seed(1000 + i)
            n = ds.ids[i].numel()
            # rows of very different magnitudes exercise the per-row fp8 scale
            scale = torch.logspace(-3, 2, n).unsqueeze(1)
            out.append(
                HiddenRecord(torch.randn(n, AUX, generator=g) * scale, torch.randn(n, LAST, generator=g))
            )
        return out

    return compute


FP = CacheFingerprint("verifier-a", (1, 2, 3), SyntheticTokens.fingerprint)


def _tensors(cache_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for shard in sorted(cache_dir.glob("shard-*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            out[shard.name] = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8"])
def test_round_trip(tmp_path: Path, dtype: str) -> None:
    ds = SyntheticTokens()
    compute = synthetic_compute(ds)
    report = build_cache(
        tmp_path / "c", ds, ComputeBackend(compute), FP, dtype=dtype, batch_size=4, shard_bytes=20_000
    )
    assert report.computed == len(ds) and report.shards_written > 1
    cache = HiddenStateCache.open(tmp_path / "c", FP)
    assert cache.is_complete() and len(cache) == len(ds)
    for i in range(len(ds)):
        want = compute([i])[0]
        got = cache.read(i, expected_ids=ds[i][0])
        assert got.aux.dtype == torch.float32 and got.aux.shape == want.aux.shape
        for g, w in ((got.aux, want.aux), (got.last, want.last)):
            if dtype == "fp32":
                assert torch.equal(g, w)
            elif dtype == "bf16":
                torch.testing.assert_close(g, w, rtol=2**-8, atol=0)
            else:
                # e4m3: 3 mantissa bits (relative error <= 2^-4) down to the subnormal step of the row scale
                row_scale = w.abs().amax(dim=1, keepdim=True) / 448
                assert ((g - w).abs() <= w.abs() * 2**-4 + row_scale * 2**-10 + 1e-12).all()
    assert verify_cache(tmp_path / "c", ds) == []


def test_fp8_halves_bf16_bytes(tmp_path: Path) -> None:
    ds = SyntheticTokens()
    sizes, payload = {}, {}
    for dtype in ("bf16", "fp8"):
        build_cache(
            tmp_path / dtype, ds, ComputeBackend(synthetic_compute(ds)), FP, dtype=dtype, batch_size=8
        )
        sizes[dtype] = HiddenStateCache.open(tmp_path / dtype).total_bytes
        t = _tensors(tmp_path / dtype)
        payload[dtype] = sum(s[k].nbytes for s in t.values() for k in ("aux", "last"))
    tokens = sum(x.numel() for x in ds.ids)
    assert payload["fp8"] * 2 == payload["bf16"]
    # on disk fp8 is half of bf16 plus two fp32 row scales per token and the int32 token ids both keep
    # (half of which is already in bf16/2), plus a safetensors header
    assert sizes["fp8"] <= sizes["bf16"] / 2 + (8 + 2) * tokens + 1024
    assert sizes["fp8"] < 0.6 * sizes["bf16"]


def test_zero_rows_survive_fp8() -> None:
    x = torch.zeros(3, 8)
    x[1] = torch.tensor([1.0, -2.0, 448.0 * 3, 0, 0, 0, 0, 1e-6])
    q, s = encode_rows(x, "fp8")
    y = decode_rows(q, s)
    assert torch.isfinite(y).all() and torch.equal(y[0], x[0]) and y[1, 2] == x[1, 2]


def test_fingerprint_mismatch_names_what_differs(tmp_path: Path) -> None:
    ds = SyntheticTokens(8)
    build_cache(tmp_path / "c", ds, ComputeBackend(synthetic_compute(ds)), FP)
    cases = {
        "another verifier": CacheFingerprint("verifier-b", FP.layer_ids, FP.dataset),
        "other layer ids": CacheFingerprint(FP.verifier, (0, 2, 3), FP.dataset),
        "other data": CacheFingerprint(FP.verifier, FP.layer_ids, "other-data"),
    }
    for reason, fp in cases.items():
        with pytest.raises(CacheMismatchError, match=reason):
            HiddenStateCache.open(tmp_path / "c", fp)
        with pytest.raises(CacheMismatchError, match=reason):
            build_cache(tmp_path / "c", ds, ComputeBackend(synthetic_compute(ds)), fp)
    with pytest.raises(CacheMismatchError, match="stores bf16, not fp8"):
        build_cache(tmp_path / "c", ds, ComputeBackend(synthetic_compute(ds)), FP, dtype="fp8")
    HiddenStateCache.open(tmp_path / "c", FP)  # the right fingerprint still opens it


def test_missing_and_corrupt_samples_are_named(tmp_path: Path) -> None:
    ds = SyntheticTokens(12)
    build_cache(tmp_path / "c", ds, ComputeBackend(synthetic_compute(ds)), FP, batch_size=4, shard_bytes=1)
    cache = HiddenStateCache.open(tmp_path / "c", FP)
    with pytest.raises(CacheMissError, match="sample 99"):
        cache.read(99)
    victim = cache.shard_of(5)
    _flip_bytes(tmp_path / "c" / victim)
    fresh = HiddenStateCache.open(tmp_path / "c", FP)
    with pytest.raises(CacheCorruptError, match=victim) as err:
        fresh.read(5)
    assert err.value.shard == victim
    fresh.read(0 if cache.shard_of(0) != victim else 11)  # other shards still read
    problems = verify_cache(tmp_path / "c", ds)
    assert len(problems) == 1 and problems[0].startswith(victim) and "sha256" in problems[0]


def test_verify_catches_token_id_mismatch(tmp_path: Path) -> None:
    ds = SyntheticTokens(6)
    build_cache(tmp_path / "c", ds, ComputeBackend(synthetic_compute(ds)), FP, shard_bytes=1)
    other = SyntheticTokens(6)
    other.ids[3] = other.ids[3].flip(0)
    problems = verify_cache(tmp_path / "c", other)
    shard = HiddenStateCache.open(tmp_path / "c").shard_of(3)
    assert problems == [f"{shard}: sample 3: token ids differ from the dataset"]
    with pytest.raises(CacheCorruptError, match="other token ids"):
        HiddenStateCache.open(tmp_path / "c").read(3, expected_ids=other.ids[3])


def test_second_build_computes_nothing(tmp_path: Path) -> None:
    ds = SyntheticTokens(10)
    calls = []
    compute = synthetic_compute(ds)

    def counting(idx: list[int]) -> list[HiddenRecord]:
        calls.append(list(idx))
        return compute(idx)

    build_cache(tmp_path / "c", ds, ComputeBackend(counting), FP, batch_size=3)
    manifest = (tmp_path / "c" / "manifest.json").read_bytes()
    n = len(calls)
    report = build_cache(tmp_path / "c", ds, ComputeBackend(counting), FP, batch_size=3)
    assert len(calls) == n and report.computed == 0 and report.skipped == len(ds)
    assert (tmp_path / "c" / "manifest.json").read_bytes() == manifest


def test_build_interrupted_between_shards_resumes_to_identical_cache(tmp_path: Path) -> None:
    ds = SyntheticTokens(30)
    compute = synthetic_compute(ds)
    kw = {"dtype": "fp8", "batch_size": 4, "shard_bytes": 6_000}
    build_cache(tmp_path / "oneshot", ds, ComputeBackend(compute), FP, **kw)

    calls = 0

    def failing(idx: list[int]) -> list[HiddenRecord]:
        nonlocal calls
        calls += 1
        if calls == 4:
            raise RuntimeError("injected failure")
        return compute(idx)

    with pytest.raises(RuntimeError, match="injected"):
        build_cache(tmp_path / "resumed", ds, ComputeBackend(failing), FP, **kw)
    partial = HiddenStateCache.open(tmp_path / "resumed", FP)
    assert 0 < len(partial) < len(ds)
    report = build_cache(tmp_path / "resumed", ds, ComputeBackend(compute), FP, **kw)
    assert report.skipped == len(partial)
    _assert_identical(tmp_path / "oneshot", tmp_path / "resumed")


def test_build_progress_counts_tokens_from_what_is_cached_to_the_total(tmp_path: Path) -> None:
    ds = SyntheticTokens(30)
    total = sum(int(t.numel()) for t in ds.ids)
    compute = synthetic_compute(ds)
    kw = {"batch_size": 4, "shard_bytes": 6_000}

    def stops_after_two_batches(idx: list[int]) -> list[HiddenRecord]:
        if stops_after_two_batches.calls == 2:  # type: ignore[attr-defined]
            raise RuntimeError("injected failure")
        stops_after_two_batches.calls += 1  # type: ignore[attr-defined]
        return compute(idx)

    stops_after_two_batches.calls = 0  # type: ignore[attr-defined]
    first: list[tuple[int, int]] = []
    with pytest.raises(RuntimeError, match="injected"):
        build_cache(
            tmp_path / "c",
            ds,
            ComputeBackend(stops_after_two_batches),
            FP,
            on_progress=lambda *a: first.append(a),
            **kw,
        )
    assert first[0] == (0, total) and len(first) == 3  # the start, then one per computed batch
    assert first[-1][0] == sum(int(t.numel()) for t in ds.ids[:8])

    cached = sum(int(ds.ids[i].numel()) for i in HiddenStateCache.open(tmp_path / "c", FP).indices())
    resumed: list[tuple[int, int]] = []
    build_cache(
        tmp_path / "c", ds, ComputeBackend(compute), FP, on_progress=lambda *a: resumed.append(a), **kw
    )
    assert resumed[0] == (cached, total)  # a resumed build starts from its cached tokens
    dones = [d for d, _ in resumed]
    assert dones == sorted(dones) and resumed[-1] == (total, total)


_CHILD = textwrap.dedent(
    """
    import sys, threading
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from test_cache import FP, SyntheticTokens, synthetic_compute
    from peagle_core.hidden_states.cache import HiddenStateCache
    from peagle_core.hidden_states.build import ComputeBackend, build_cache

    out, marker = Path(sys.argv[1]), Path(sys.argv[2])
    ds = SyntheticTokens(30)
    compute = synthetic_compute(ds)

    def compute_then_hang(idx):
        # once a shard is committed and the next one is half-buffered, wait to be killed
        if (out / "manifest.json").exists() and len(HiddenStateCache.open(out)) >= 8:
            marker.write_text("ready")
            threading.Event().wait()
        return compute(idx)

    build_cache(out, ds, ComputeBackend(compute_then_hang), FP, dtype="bf16", batch_size=4, shard_bytes=6_000)
    """
)


def test_build_killed_with_sigkill_resumes_to_identical_cache(tmp_path: Path) -> None:
    from tests.fixtures.wait import wait_until  # here: _CHILD imports this module without the tests package

    ds = SyntheticTokens(30)
    kw = {"dtype": "bf16", "batch_size": 4, "shard_bytes": 6_000}
    build_cache(tmp_path / "oneshot", ds, ComputeBackend(synthetic_compute(ds)), FP, **kw)

    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(tests=str(Path(__file__).parent)))
    marker = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "killed"), str(marker)])

    def at_second_shard() -> bool:
        assert proc.poll() is None, "the build exited before it could be killed"
        return marker.exists()

    try:
        wait_until(at_second_shard, message="the build to reach its second shard", timeout=120)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    partial = HiddenStateCache.open(tmp_path / "killed", FP)
    assert 8 <= len(partial) < len(ds)
    # a temporary left by a writer killed mid-shard must not survive the resume
    (tmp_path / "killed" / ".shard-00009.safetensors.tmp-dead").write_bytes(b"half a shard")
    build_cache(tmp_path / "killed", ds, ComputeBackend(synthetic_compute(ds)), FP, **kw)
    assert not list((tmp_path / "killed").glob(".shard-*.tmp-*"))
    _assert_identical(tmp_path / "oneshot", tmp_path / "killed")


def _assert_identical(a: Path, b: Path) -> None:
    assert json.loads((a / "manifest.json").read_text()) == json.loads((b / "manifest.json").read_text())
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    for shard in ta:
        assert ta[shard].keys() == tb[shard].keys()
        for k in ta[shard]:
            assert torch.equal(ta[shard][k].view(torch.uint8), tb[shard][k].view(torch.uint8)), (shard, k)


def _flip_bytes(path: Path, at: float = 0.6, n: int = 4) -> None:
    data = bytearray(path.read_bytes())
    pos = int(len(data) * at)
    for k in range(n):
        data[pos + k] ^= 0xFF
    path.write_bytes(bytes(data))
