"""The drafter's own Llama blocks equal transformers' `modeling_llama`, and importing the training hot path
loads no transformers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama as hf

from peagle_core.model import layers


def _config(rope: dict) -> LlamaConfig:
    return LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, rope_parameters=rope, max_position_embeddings=512)  # fmt: skip


def test_rmsnorm_and_mlp_equal_transformers_bit_for_bit() -> None:
    torch.manual_seed(0)
    cfg = _config({"rope_type": "default", "rope_theta": 10000.0})
    ours_norm, theirs_norm = layers.RMSNorm(64, eps=1e-5), hf.LlamaRMSNorm(64, eps=1e-5)
    ours_mlp, theirs_mlp = layers.MLP(64, 96), hf.LlamaMLP(cfg)
    for ours, theirs in ((ours_norm, theirs_norm), (ours_mlp, theirs_mlp)):
        theirs.load_state_dict(ours.state_dict())  # same parameter names, or this raises
        torch.nn.init.normal_(next(iter(ours.parameters())))
        theirs.load_state_dict(ours.state_dict())
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(3, 7, 64, dtype=dtype)
            assert torch.equal(ours.to(dtype)(x), theirs.to(dtype)(x))


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 100000.0},
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ],
)  # fmt: skip
def test_rotary_equals_transformers(rope: dict) -> None:
    cfg = _config(rope)
    ours = layers.rotary_embedding(16, rope, lambda: cfg)
    theirs = hf.LlamaRotaryEmbedding(cfg)
    x = torch.randn(2, 9, 64)
    pos = torch.arange(300, 309).expand(2, 9)
    cos, sin = ours(x, pos)
    ref_cos, ref_sin = theirs(x, pos)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    q, k = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 9, 16)
    got = layers.apply_rotary(q, k, cos, sin)
    want = hf.apply_rotary_pos_emb(q, k, ref_cos, ref_sin)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_the_training_hot_path_imports_no_transformers() -> None:
    # A fresh interpreter: this test process has transformers loaded already.
    code = (
        "import sys, json\n"
        "import peagle_core.model.drafter, peagle_core.model.objective, peagle_core.model.loss\n"
        "import peagle_core.model.cod, peagle_core.model.attention, peagle_core.model.partition\n"
        "print(json.dumps({'transformers': sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'),"
        " 'modules': len(sys.modules)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = json.loads(out.strip().splitlines()[-1])
    assert loaded["transformers"] == []


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_token_embedding_equals_nn_embedding_forward_and_gradient(compiled: bool) -> None:
    # Repeated ids (their rows' gradients sum), bf16 autocast (the lookup stays in the weight's dtype), and
    # in a compiled function, row counts that change from call to call, as COD's do.
    torch.manual_seed(0)
    ours = layers.TokenEmbedding(300, 24)
    theirs = torch.nn.Embedding(300, 24)
    theirs.load_state_dict(ours.state_dict())

    def loss(module: torch.nn.Module, ids: torch.Tensor, probe: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (module(ids) * probe).sum()

    ours_loss = torch.compile(loss, dynamic=True) if compiled else loss
    for n in (7, 50, 129):
        ids = torch.randint(0, 300, (n,))
        ids[: n // 2] = ids[0]
        probe = torch.randn(n, 24)
        ours.zero_grad(), theirs.zero_grad()
        got, want = ours_loss(ours, ids, probe), loss(theirs, ids, probe)
        got.backward(), want.backward()
        # The loss is a sum of n x 24 products: Inductor's reduction order differs from eager's (on AVX2,
        # 4e-5 on 16.5 was seen); the gradients below carry no reduction and stay tight.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, rtol=1e-6, atol=1e-6)
        assert ours.weight.grad.dtype == torch.float32


def test_compiled_token_embedding_gradient_is_the_same_on_every_call() -> None:
    # Many rows share few ids across two threads: atomic adds would sum them in a varying order.
    torch.set_num_threads(2)  # the suite's one thread is restored after (tests/core/conftest.py)
    torch.manual_seed(0)
    emb = layers.TokenEmbedding(1000, 576)
    ids, probe = torch.randint(0, 50, (4097,)), torch.randn(4097, 576)
    loss = torch.compile(lambda i: (emb(i) * probe).sum(), dynamic=True)
    grads = []
    for _ in range(6):
        emb.zero_grad()
        loss(ids).backward()
        grads.append(emb.weight.grad.clone())
    assert all(torch.equal(grads[0], g) for g in grads[1:])
