"""Muon for the drafter's weight matrices and AdamW for the rest, stepped, scheduled and saved as one optimizer.

torch's `Muon` only takes 2-D matrices; embeddings, the lm_head, norms and biases keep AdamW (as in Muon's
own recipe). One `torch.optim.Optimizer` holds every group, so the LR schedule, gradient clipping and
checkpoints (plain `state_dict` and torch.distributed.checkpoint) see a single optimizer. Each inner
optimizer is handed the outer's group dicts and state, so a scheduler's `lr` and a loaded state reach it.
"""

from __future__ import annotations

from typing import Any

import torch


class MuonAdamW(torch.optim.Optimizer):
    """`muon_groups` stepped by torch's Muon (matched to AdamW's update RMS, so AdamW's lr and weight decay
    carry over), `adamw_groups` by fused AdamW with `betas`."""

    def __init__(
        self,
        muon_groups: list[dict[str, Any]],
        adamw_groups: list[dict[str, Any]],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
    ):
        muon = torch.optim.Muon(muon_groups, lr=lr, adjust_lr_fn="match_rms_adamw")
        adamw = torch.optim.AdamW(adamw_groups, lr=lr, betas=betas, fused=True)
        for group in muon.param_groups:
            group["kind"] = "muon"
        for group in adamw.param_groups:
            group["kind"] = "adamw"
        super().__init__(muon.param_groups + adamw.param_groups, {"lr": lr})
        self._inner = {"muon": muon, "adamw": adamw}
        self._link()

    def _link(self) -> None:
        # Inner optimizers read the outer's group dicts (a scheduler's lr) and state (a restored one).
        for kind, inner in self._inner.items():
            inner.param_groups = [g for g in self.param_groups if g["kind"] == kind]
            inner.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # replaces self.param_groups with new dicts
        self._link()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for inner in self._inner.values():
            if inner.param_groups:
                inner.step()
        return loss
