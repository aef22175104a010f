"""The verifier runner: aux/last hidden states, logits, fingerprint, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peagle_core.errors import VerifierError
from peagle_core.hidden_states.verifier import Verifier
from peagle_core.model.config import default_layer_ids


def test_hidden_states_shapes_and_sources(toy_verifier: Verifier) -> None:
    v = toy_verifier
    assert v.layer_ids == default_layer_ids(v.num_layers)
    assert v.dtype == torch.float32 and v.device.type == "cpu"
    ids = torch.randint(0, v.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    calls = v.calls
    aux, last = v.hidden_states(ids)
    assert v.calls == calls + 1
    assert aux.shape == (2, 9, 3 * v.hidden_size) and last.shape == (2, 9, v.hidden_size)

    with torch.inference_mode():
        ref = v.model(input_ids=ids, output_hidden_states=True)
    # aux: hidden_states[i] (the input of decoder layer i) for each layer id, in order
    expected = torch.cat([ref.hidden_states[i] for i in v.layer_ids], dim=-1)
    torch.testing.assert_close(aux, expected, rtol=0, atol=0)
    # last: the final norm's input, so norm + lm_head reproduces the logits
    torch.testing.assert_close(v.final_norm(last) @ v.lm_head_weight.T, ref.logits, rtol=1e-5, atol=1e-5)
    # ... and it is not the already-normed tensor
    assert not torch.allclose(last, v.final_norm(last), atol=1e-3)

    logits, aux2 = v.logits(ids)
    assert logits.shape == (2, 9, v.vocab_size)
    torch.testing.assert_close(aux2, aux)
    torch.testing.assert_close(logits, ref.logits)


def test_padded_batch_matches_single_sequences(toy_verifier: Verifier) -> None:
    a = torch.tensor([[2, 10, 11, 12, 13, 14]])
    b = torch.tensor([[2, 20, 21]])
    batch = torch.tensor([[2, 10, 11, 12, 13, 14], [2, 20, 21, 0, 0, 0]])
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0]])
    aux, last = toy_verifier.hidden_states(batch, attention_mask=mask)
    aux_a, last_a = toy_verifier.hidden_states(a)
    aux_b, last_b = toy_verifier.hidden_states(b)
    torch.testing.assert_close(aux[0], aux_a[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last[0], last_a[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux[1, :3], aux_b[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last[1, :3], last_b[0], rtol=1e-5, atol=1e-5)


def test_two_threads_share_one_verifier(toy_verifier: Verifier) -> None:
    # The trainer's batch loader runs the verifier in its thread while the main thread evaluates with it:
    # each forward must get its own final-norm input back (a job once failed "final norm was not called").
    from concurrent.futures import ThreadPoolExecutor

    ids = torch.randint(8, toy_verifier.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    want_aux, want_last = toy_verifier.hidden_states(ids)

    def run(_: int) -> bool:
        aux, last = toy_verifier.hidden_states(ids)
        _, aux2 = toy_verifier.logits(ids)
        return torch.equal(aux, want_aux) and torch.equal(last, want_last) and torch.equal(aux2, want_aux)

    with ThreadPoolExecutor(max_workers=4) as pool:
        assert all(pool.map(run, range(64)))


def test_fingerprint_is_the_files_content(
    toy_verifier: Verifier, toy_verifier_dir: Path, tmp_path: Path
) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    from peagle_core.keys import verifier_fingerprint

    fp = toy_verifier.fingerprint
    assert len(fp) == 64 and fp == verifier_fingerprint(toy_verifier_dir)
    # Another name for the same files: the same verifier. One weight changed: another verifier.
    copy = tmp_path / "same-verifier-other-name"
    shutil.copytree(toy_verifier_dir, copy)
    assert Verifier.load(str(copy), device="cpu").fingerprint == fp
    (weights,) = copy.glob("*.safetensors")
    state = load_file(weights)
    name = next(k for k in state if k.endswith("up_proj.weight"))
    state[name][0, 0] += 1.0
    save_file(state, weights, metadata={"format": "pt"})
    assert Verifier.load(str(copy), device="cpu").fingerprint != fp


def test_explicit_layer_ids_and_errors(toy_verifier_dir: Path, tmp_path: Path) -> None:
    v = Verifier.load(str(toy_verifier_dir), device="cpu", layer_ids=[1, 2, 3])
    aux, _ = v.hidden_states(torch.tensor([[2, 5, 6]]))
    with torch.inference_mode():
        ref = v.model(input_ids=torch.tensor([[2, 5, 6]]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(aux[..., : v.hidden_size], ref[1])
    torch.testing.assert_close(aux[..., -v.hidden_size :], ref[3])

    # Captured in layer order whatever order they are given in: vLLM gathers them that way.
    unsorted = Verifier(v.model, v.tokenizer, str(toy_verifier_dir), layer_ids=[3, 1, 2])
    assert unsorted.layer_ids == [1, 2, 3]
    torch.testing.assert_close(unsorted.hidden_states(torch.tensor([[2, 5, 6]]))[0], aux)

    with pytest.raises(VerifierError, match="layer_ids") as exc:
        Verifier.load(str(toy_verifier_dir), device="cpu", layer_ids=[1, 2, 9])
    assert exc.value.code == "verifier_unsupported"
    with pytest.raises(VerifierError) as exc:
        Verifier.load(str(tmp_path / "missing"))
    assert exc.value.code == "verifier_not_found"
    (tmp_path / "empty").mkdir()
    with pytest.raises(VerifierError) as exc:
        Verifier.load(str(tmp_path / "empty"))
    assert exc.value.code in ("verifier_not_found", "verifier_unavailable")


@pytest.mark.cuda
def test_cuda_runs_bf16_and_matches_cpu(toy_verifier: Verifier, toy_verifier_dir: Path) -> None:
    v = Verifier.load(str(toy_verifier_dir), device="cuda")
    assert v.dtype == torch.bfloat16 and v.device.type == "cuda"
    ids = torch.randint(0, v.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    aux, last = v.hidden_states(ids)
    assert aux.dtype == torch.bfloat16 and aux.device.type == "cuda"
    ref_aux, ref_last = toy_verifier.hidden_states(ids)
    torch.testing.assert_close(aux.float().cpu(), ref_aux, rtol=0.05, atol=0.05)
    torch.testing.assert_close(last.float().cpu(), ref_last, rtol=0.05, atol=0.05)
