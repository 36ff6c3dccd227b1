"""The sparse mixture-of-experts block of the SDAR-MoE / Qwen3-MoE decoder (SDAR-30B-A3B).

Router: ``logits = x @ gate.weight.T`` (``num_experts`` outputs, no bias), softmax over the
experts in float32 for every dtype (as transformers and lmdeploy compute it), the ``num_experts_per_tok`` largest
probabilities and their experts (``torch.topk``), renormalised to sum 1 when
``norm_topk_prob``. Experts: :func:`simsd_kernels.moe.fused_moe` (each a SwiGLU MLP of width
``moe_intermediate_size``; the weighted sum of the chosen experts' outputs). Source of the
behaviour: transformers' ``Qwen3MoeSparseMoeBlock`` (the parity reference,
tests/simsd/models/test_moe_parity.py) and lmdeploy's ``SDARMoeSparseMoeBlock``.

Weights are held stacked, ``experts.gate_up_proj (E, 2I, H)`` and ``experts.down_proj
(E, H, I)``, the layout of fused MoE kernels; the state dict shows (and loading takes) the
per-expert names of the SDAR-MoE checkpoints, ``experts.{e}.gate_proj.weight (I, H)``,
``experts.{e}.up_proj.weight (I, H)``, ``experts.{e}.down_proj.weight (H, I)``, next to the
router's ``gate.weight (E, H)``.
"""
from __future__ import annotations

import torch
from torch import nn

from simsd_kernels.moe import fused_moe

from .config import ModelConfig

CHECKPOINT_NAMES = ("gate_proj", "up_proj", "down_proj")


class TopKRouter(nn.Module):
    """``x (T, H)`` -> ``(weights (T, k) float32, ids (T, k) int64)`` (module doc)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob

    def forward(self, x: torch.Tensor):
        logits = nn.functional.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


class Experts(nn.Module):
    """The stacked expert weights; per-expert names in the state dict (module doc)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))
        self.register_state_dict_post_hook(_split_experts)
        self.register_load_state_dict_pre_hook(_stack_experts)

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj.shape[0]


def _split_experts(module: Experts, state_dict, prefix, local_metadata) -> None:
    gate_up = state_dict.pop(prefix + "gate_up_proj")
    down = state_dict.pop(prefix + "down_proj")
    I = down.shape[2]
    for e in range(gate_up.shape[0]):
        state_dict[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, :I]
        state_dict[f"{prefix}{e}.up_proj.weight"] = gate_up[e, I:]
        state_dict[f"{prefix}{e}.down_proj.weight"] = down[e]


def _stack_experts(module: Experts, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                   error_msgs) -> None:
    """Per-expert checkpoint tensors -> the stacked parameters (an expert with any tensor missing is
    left for ``load_state_dict`` to report as missing)."""
    E = module.num_experts
    names = {n: [f"{prefix}{e}.{n}.weight" for e in range(E)] for n in CHECKPOINT_NAMES}
    if not all(k in state_dict for keys in names.values() for k in keys):
        return
    parts = {n: [state_dict.pop(k) for k in keys] for n, keys in names.items()}
    state_dict[prefix + "gate_up_proj"] = torch.stack(
        [torch.cat([g, u], 0) for g, u in zip(parts["gate_proj"], parts["up_proj"])])
    state_dict[prefix + "down_proj"] = torch.stack(parts["down_proj"])


class SparseMoeBlock(nn.Module):
    """Router and experts; ``x (..., H)`` -> ``(..., H)`` in x's dtype (the dense MLP's interface).

    Attribute ``backend`` (``auto | torch``): passed to :func:`simsd_kernels.moe.fused_moe`.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = TopKRouter(config)
        self.experts = Experts(config)
        self.backend = "auto"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.gate(flat)
        out = fused_moe(flat, self.experts.gate_up_proj, self.experts.down_proj, weights, ids, backend=self.backend)
        return out.view(x.shape)
