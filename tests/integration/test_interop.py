"""Interop both ways: each drafter layer family we write serves in real vLLM with output unchanged;
speculators 0.9.0 loads our export, and a checkpoint its own save path wrote loads into our drafter for
evaluation and continued training (`model.init_from`).

One qwen3 drafter is trained through the job spec for a few steps (the module fixture); the llama family
is the default every other serving test trains.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peagle_core.errors import CheckpointError
from peagle_core.evaluation.acceptance import evaluate
from peagle_core.model.drafter import PEagleDraftModel
from peagle_core.pipeline.stages import run_pipeline
from peagle_core.spec import parse_spec
from tests.fixtures.vllm import SERVING_NEW_TOKENS

K = 3


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Our side runs torch on one thread, as tests/core does: these tensors are tiny, and extra intra-op
    threads on a shared 2-core machine slow evaluation and training 10-40x (vLLM has its own process)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def job(verifier_dir: Path, data_path: Path, *, model: dict, **training) -> dict:
    """A short job on the toy verifier: fp32 export, no in-training evaluation (the tests evaluate)."""
    return {
        "verifier": {"name_or_path": str(verifier_dir)},
        "dataset": {"path": str(data_path), "seq_len": 128, "val_fraction": 0.1},
        "hidden_states": {"mode": "online"},
        "model": {"num_layers": 1, "num_depths": K, **model},
        "training": {"total_seq_len": 512, "lr": 3e-3, "warmup_ratio": 0.1, "seed": 3, **training},
        "evaluation": {"prompts": 0},
        "export": {"dtype": "fp32"},
    }


@pytest.fixture(scope="module")
def qwen3_drafter(tmp_path_factory, toy_verifier_dir: Path, toy_dataset_path: Path):
    """A qwen3-layer drafter trained from `model.layer_type: qwen3` (~100 steps: enough that dropping its
    q/k norm changes the acceptance length by ~10%, so vLLM agreeing with us proves it applies them)."""
    spec = parse_spec(
        job(
            toy_verifier_dir,
            toy_dataset_path,
            model={"layer_type": "qwen3", "draft_vocab_size": 256},
            epochs=6,
            total_seq_len=256,
        )
    )
    result = run_pipeline(spec, tmp_path_factory.mktemp("qwen3_job"), resume=False)
    assert result.status == "completed"
    return result.model.eval(), result.export_dir


def our_acceptance(model, toy_verifier, prompts: list[list[int]]) -> float:
    eos = toy_verifier.tokenizer.eos_token_id
    tensors = [torch.tensor(p) for p in prompts]
    return evaluate(model, toy_verifier, tensors, K, SERVING_NEW_TOKENS, eos_token_id=eos).acceptance_length


def untrained_llama(toy_verifier) -> PEagleDraftModel:
    from peagle_core.model.config import PEagleConfig

    torch.manual_seed(0)
    config = PEagleConfig.from_verifier(
        toy_verifier.config,
        num_layers=1,
        num_depths=K,
        draft_vocab_size=None,
        mask_token_id=3,
        aux_layer_ids=list(toy_verifier.layer_ids),
    )
    model = PEagleDraftModel(config)
    model.init_embeddings(toy_verifier.embed_weight.detach().float())
    model.init_lm_head(toy_verifier.lm_head_weight)
    return model.eval()


@pytest.mark.parametrize("layer_type", ["llama", "qwen3"])
def test_each_layer_type_serves_in_vllm_with_greedy_output_unchanged(
    layer_type, tmp_path, qwen3_drafter, toy_verifier, toy_verifier_dir, vllm_engine, serving_prompts,
    plain_greedy,
) -> None:  # fmt: skip
    from peagle_core.model.speculators import read_checkpoint
    from peagle_core.serving.export import export_checkpoint

    if layer_type == "qwen3":
        model, export_dir = qwen3_drafter
    else:
        model = untrained_llama(toy_verifier)
        export_dir = export_checkpoint(
            model, tmp_path / "llama", verifier_name_or_path=str(toy_verifier_dir), dtype="fp32"
        )
    config, state = read_checkpoint(export_dir)
    assert config.layer_type == layer_type
    has_qk_norm = "layers.0.self_attn.q_norm.weight" in state and "layers.0.self_attn.k_norm.weight" in state
    assert has_qk_norm == (layer_type == "qwen3")

    run = vllm_engine.generate(
        str(toy_verifier_dir), serving_prompts, SERVING_NEW_TOKENS, drafter=str(export_dir), k=K
    )
    assert run.tokens == plain_greedy
    assert run.num_drafts > 0
    if layer_type == "qwen3":
        # vLLM's Qwen3 drafter and ours compute the same drafts: the same greedy chain accepts as much.
        ours = our_acceptance(model, toy_verifier, serving_prompts)
        print(f"acceptance length: vLLM {run.acceptance_length:.3f}, ours {ours:.3f}")
        assert ours > 1.2, "the trained drafter should accept drafts, or this comparison proves nothing"
        assert run.acceptance_length == pytest.approx(ours, rel=0.03)


def save_with_speculators(model: PEagleDraftModel, verifier_dir: Path, out: Path) -> Path:
    """`model`'s weights in a checkpoint written by speculators 0.9.0's own classes and save path."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.peagle import PEagleDraftModel as SpeculatorsPEagle
    from speculators.models.peagle import PEagleSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    c = model.config
    layer = Qwen3Config(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        num_hidden_layers=c.num_layers,
        vocab_size=c.vocab_size,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        rope_parameters=dict(c.rope_parameters),
    )
    config = PEagleSpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=c.draft_vocab_size,
        norm_before_residual=c.norm_before_residual,
        eagle_aux_hidden_state_layer_ids=list(c.aux_layer_ids),
        mask_token_id=c.mask_token_id,
        speculators_config=SpeculatorsConfig(
            algorithm="peagle",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=c.num_depths)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(str(verifier_dir)),
        ),
    )
    theirs = SpeculatorsPEagle(config)
    missing, unexpected = theirs.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and set(missing) == {"verifier_lm_head.weight", "verifier_norm.weight"}
    theirs.save_pretrained(str(out))
    return out


def test_speculators_reads_our_export_and_we_evaluate_and_train_from_its_save(
    tmp_path, qwen3_drafter, toy_verifier, toy_verifier_dir, toy_dataset_path, serving_prompts
) -> None:
    from speculators.models.peagle import PEagleDraftModel as SpeculatorsPEagle

    model, export_dir = qwen3_drafter
    # The other way first: speculators' own loader reads our export, tensor for tensor.
    theirs = SpeculatorsPEagle.from_pretrained(str(export_dir)).state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(theirs[name], tensor), name

    saved = save_with_speculators(model, toy_verifier_dir, tmp_path / "speculators")

    loaded = PEagleDraftModel.from_pretrained(saved).eval()
    assert loaded.config.layer_type == "qwen3"
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    prompts = serving_prompts[:3]
    assert our_acceptance(loaded, toy_verifier, prompts) == our_acceptance(model, toy_verifier, prompts)

    # Continued training from it: a tiny learning rate keeps the weights next to the checkpoint's.
    spec = parse_spec(
        job(toy_verifier_dir, toy_dataset_path, model={"init_from": str(saved)}, max_steps=2, lr=1e-7)
    )
    result = run_pipeline(spec, tmp_path / "continued", resume=False)
    assert result.status == "completed" and result.step == 2
    fine_tuned = PEagleDraftModel.from_pretrained(result.export_dir)
    assert fine_tuned.config.layer_type == "qwen3" and fine_tuned.config.draft_vocab_size == 256
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(fine_tuned.state_dict()[name], tensor, atol=1e-5, rtol=0, msg=name)


def test_init_from_errors_name_the_field(tmp_path, qwen3_drafter, toy_verifier_dir, toy_dataset_path) -> None:
    _, export_dir = qwen3_drafter

    def failure(layer_ids: list[int] | None = None, **model) -> CheckpointError:
        spec = parse_spec(job(toy_verifier_dir, toy_dataset_path, model=model, max_steps=1))
        spec.verifier.layer_ids = layer_ids
        with pytest.raises(CheckpointError) as info:
            run_pipeline(spec, tmp_path / "job", resume=False)
        return info.value

    err = failure(init_from=str(tmp_path / "nowhere"))
    assert err.param == "model.init_from" and "config.json: missing" in err.message
    err = failure(init_from=str(export_dir), num_layers=2)
    assert err.param == "model.num_layers" and "checkpoint's is 1" in err.message
    err = failure(init_from=str(export_dir), layer_type="llama")
    assert err.param == "model.layer_type"
    err = failure(init_from=str(export_dir), layer_ids=[1, 2, 3])
    assert err.param == "verifier.layer_ids" and "verifier layers [0, 2, 3]" in err.message
