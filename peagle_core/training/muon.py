"""Muon for the drafter's weight matrices and AdamW for the rest, stepped, scheduled and saved as one optimizer.

torch's `Muon` only takes 2-D matrices; embeddings, the lm_head, norms and biases keep AdamW (as in Muon's
own recipe). One `torch.optim.Optimizer` holds every group, so the LR schedule, gradient clipping and
checkpoints (plain `state_dict` and torch.distributed.checkpoint) see a single optimizer. Each inner
optimizer is handed the outer's group dicts and state, so a scheduler's `lr` and a loaded state reach it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from peagle_core.model.precision import has_fast_bf16


def newton_schulz(
    grad: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """Muon's orthogonalization of a 2-D update, as torch's Muon computes it, in `dtype` (torch fixes bf16);
    a [B, rows, cols] stack orthogonalizes each of its B matrices (batched matmuls: one call for several
    same-shaped small matrices, where per-call overhead is most of the cost)."""
    a, b, c = coefficients
    x = grad.to(dtype)
    tall = grad.size(-2) > grad.size(-1)
    if tall:
        x = x.mT
    if x.dim() == 2:
        # spectral norm at most 1; out of place: in fp32, `x` may be the momentum buffer itself
        x = x / x.norm().clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def closure_loss(closure: Any) -> Any:
    """An optimizer's `closure` re-evaluated with grad enabled (the step itself runs without)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def adjusted_lr(lr: float, rule: str | None, shape: torch.Size) -> float:
    """torch's Muon learning-rate adjustment for a [A, B] matrix (`adjust_lr_fn`)."""
    rows, cols = shape[:2]
    if rule is None or rule == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if rule == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


class Muon(torch.optim.Muon):
    """torch's Muon (its groups, state and update rule) with the Newton-Schulz iterations in `ns_dtype`.

    torch runs them in bf16, which is right where bf16 matmuls are fast (CUDA, AMX or AVX512-BF16). A CPU
    without either emulates bf16: there the orthogonalization took ~90% of a SmolLM2-shaped K=2 step
    (py-spy, AVX2 EPYC, docs/decisions.md), so it runs in fp32 instead, exact to a few ulps of bf16.
    """

    def __init__(self, params: Any, *, ns_dtype: torch.dtype = torch.bfloat16, **kwargs: Any):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure_loss(closure)
        for group in self.param_groups:
            lr, momentum = float(group["lr"]), group["momentum"]
            # Matrices of one shape (transposed to wide) are orthogonalized as one batch: SmolLM2's
            # gate, up and down projections, k and v (~10 ms of ~60 a step on 2 AMX cores).
            batches: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(param.grad, 1 - momentum)
                update = param.grad.lerp(buf, momentum) if group["nesterov"] else buf
                wide = update if update.size(0) <= update.size(1) else update.T
                batches.setdefault(tuple(wide.shape), []).append((param, update))
            for members in batches.values():
                updates = [u if u.size(0) <= u.size(1) else u.T for _, u in members]
                stacked = updates[0] if len(updates) == 1 else torch.stack(updates)
                ortho = newton_schulz(stacked, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                      self.ns_dtype)  # fmt: skip
                for i, (param, update) in enumerate(members):
                    o = ortho if len(members) == 1 else ortho[i]
                    o = o if update.size(0) <= update.size(1) else o.T
                    param.mul_(1 - lr * group["weight_decay"])
                    param.add_(o, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], param.shape))
        return loss


class MuonAdamW(torch.optim.Optimizer):
    """`muon_groups` stepped by Muon (torch's update scaled to AdamW's RMS, so AdamW's lr and weight decay
    carry over; Newton-Schulz in bf16 only where bf16 is fast), `adamw_groups` by fused AdamW with `betas`."""

    def __init__(
        self,
        muon_groups: list[dict[str, Any]],
        adamw_groups: list[dict[str, Any]],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
    ):
        device = next((p.device for g in muon_groups for p in g["params"]), torch.device("cpu"))
        ns_dtype = torch.bfloat16 if has_fast_bf16(device) else torch.float32
        muon = Muon(muon_groups, lr=lr, adjust_lr_fn="match_rms_adamw", ns_dtype=ns_dtype)
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
        loss = closure_loss(closure)
        for inner in self._inner.values():
            if inner.param_groups:
                inner.step()
        return loss
