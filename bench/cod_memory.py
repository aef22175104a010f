"""COD against naive all-depth expansion: time, tokens/s, MFU and peak RSS of one CPU fp32 training step.

Each config runs in its own process so its peak RSS is its own. Prints one JSON line per config:
`step_mem_mb` is the peak RSS of the first full step (forward, backward, AdamW) minus the RSS just before
it; `steady_step_mem_mb` the same over all steps (allocator reuse across steps adds to it); `peak_rss_mb`
the process peak; `step_s` the fastest step after the first.
Usage: python bench/cod_memory.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, gemm_peak_flops, peak_rss_mb, rss_mb, run_child

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 256, 2, 4, 2, 64, 1024
DRAFT_VOCAB, VOCAB = 1024, 4096


def _model(num_depths: int, ratio: float, ratio_min: float):
    """The drafter and a random verifier head's teacher."""
    from peagle_core.model.config import PEagleConfig
    from peagle_core.model.drafter import PEagleDraftModel
    from peagle_core.model.objective import Teacher

    cfg = PEagleConfig(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        intermediate_size=INTERMEDIATE, vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, num_layers=LAYERS,
        num_depths=num_depths, down_sample_ratio=ratio, down_sample_ratio_min=ratio_min, mask_token_id=VOCAB - 1,
    )  # fmt: skip
    model = PEagleDraftModel(cfg)
    model.set_vocab_map(torch.arange(VOCAB) < DRAFT_VOCAB, torch.zeros(DRAFT_VOCAB, dtype=torch.long))
    norm = torch.nn.RMSNorm(HIDDEN, eps=1e-6)
    return model, Teacher.from_verifier(norm, torch.randn(VOCAB, HIDDEN) * 0.05, model.verifier_ids())


def _step_flops(model, cod: tuple[torch.Tensor, torch.Tensor], seq_len: int) -> float:
    """Useful FLOPs of one training step (forward 2, backward 4 per multiply-accumulate)."""
    from peagle_core.model.attention import AttentionLayout

    anchor, depth = cod
    rows = anchor.numel()
    qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    per_row = HEADS * HEAD_DIM * HIDDEN + 3 * HIDDEN * INTERMEDIATE  # o_proj + MLP, every layer
    macs = LAYERS * rows * per_row + (LAYERS - 1) * rows * HIDDEN * qkv
    macs += (seq_len + 1) * (2 * HIDDEN * qkv + 3 * HIDDEN * HIDDEN)  # layer-0 qkv + fc on distinct rows
    macs += rows * HIDDEN * DRAFT_VOCAB  # lm_head (loss mask is all ones here)
    layout = AttentionLayout.build(anchor, depth, torch.zeros(seq_len, dtype=torch.long))
    keys = float((layout.key_hi - layout.key_lo + 1).sum() + depth.sum())
    attn = LAYERS * keys * 2 * HEADS * HEAD_DIM  # QK^T and PV
    teacher = seq_len * HIDDEN * DRAFT_VOCAB
    return 6 * (macs + attn) + 2 * teacher


def child(num_depths: int, ratio: float, ratio_min: float, seq_len: int, peak: float, steps: int) -> None:
    from peagle_core.model.objective import distillation_loss, sample_rows

    torch.manual_seed(0)
    model, teacher = _model(num_depths, ratio, ratio_min)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = SimpleNamespace(  # one document filling the row, every position a loss position
        hidden_states=torch.randn(1, seq_len, 3 * HIDDEN),
        input_ids=torch.randint(0, VOCAB - 1, (1, seq_len)),
        verifier_last_hidden_states=torch.randn(1, seq_len, HIDDEN),
        loss_mask=torch.ones(1, seq_len, dtype=torch.long),
        document_ids=torch.zeros(1, seq_len, dtype=torch.long),
        position_ids=torch.arange(seq_len)[None],
    )
    cod = sample_rows(model.config, batch, torch.Generator().manual_seed(0))

    rss_before = rss_mb()
    times, first_step_peak = [], 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        out = distillation_loss(model, teacher, batch, cod)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        first_step_peak = first_step_peak or peak_rss_mb()
    # The first step pays one-off costs (page faults, optimizer state); time the steady ones.
    step_s = min(times[1:] or times)
    peak_rss = peak_rss_mb()
    emit(
        num_depths=num_depths, ratio=ratio, ratio_min=ratio_min, seq_len=seq_len, positions=int(cod[0].numel()),
        peak_rss_mb=round(peak_rss, 1), step_mem_mb=round(first_step_peak - rss_before, 1),
        steady_step_mem_mb=round(peak_rss - rss_before, 1), step_s=round(step_s, 3),
        tokens_per_s=round(seq_len / step_s, 1), mfu=round(_step_flops(model, cod, seq_len) / step_s / peak, 4),
        loss=round(float(out.loss.detach()), 4), steps=steps, threads=torch.get_num_threads(),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="seq_len 512, one step: a smoke run")
    parser.add_argument("--child", nargs=5, metavar=("K", "R", "RMIN", "SEQ", "PEAK"), help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    if args.child:
        k, r, r_min, seq, peak = args.child
        child(int(k), float(r), float(r_min), int(seq), float(peak), args.steps or 1)
        return
    seq_len = 512 if args.quick else 2048
    steps = args.steps or (1 if args.quick else 3)
    peak = gemm_peak_flops()
    emit(measurement="fp32_gemm_peak", gflops=round(peak / 1e9, 2), threads=torch.get_num_threads())
    for k in (4, 8):
        for r, r_min in ((0.7, 0.2), (1.0, 1.0)):
            for line in run_child(
                [
                    __file__,
                    "--steps",
                    str(steps),
                    "--child",
                    str(k),
                    str(r),
                    str(r_min),
                    str(seq_len),
                    str(peak),
                ]
            ):
                print_line = line
                emit(**print_line)


if __name__ == "__main__":
    main()
