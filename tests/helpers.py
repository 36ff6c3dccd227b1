"""Shared test helpers: small random SDAR checkpoints (cached per session)."""
from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import torch

from simsd.testing import make_random_checkpoint

_ROOT = Path(tempfile.mkdtemp(prefix="simsd-tests-"))


@functools.lru_cache(maxsize=None)
def random_checkpoint(name: str = "base", **kwargs) -> Path:
    """A random SDAR checkpoint directory, created once per test session per argument set."""
    path = _ROOT / (name + "-" + "-".join(f"{k}{v}" for k, v in sorted(kwargs.items())))
    if not (path / "config.json").exists():
        make_random_checkpoint(path, **kwargs)
    return path


def plain_qwen3_twin(sdar: Path, path: Path) -> Path:
    """A copy of the SDAR checkpoint ``sdar`` whose config.json reads as a plain autoregressive
    Qwen3's (model_type qwen3, Qwen3ForCausalLM, no block_size, no mask_token_id): the same
    weights under another declaration."""
    import json
    import shutil
    shutil.copytree(sdar, path)
    cfg = json.loads((path / "config.json").read_text())
    for key in ("block_size", "mask_token_id"):
        cfg.pop(key, None)
    cfg.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def context_free_checkpoint(mask_logits, mask_id: int, seed: int = 0):
    """A float64 checkpoint whose logits at a MASK position are exactly ``mask_logits`` (V,)
    whatever the context: attention and MLP write nothing back (o_proj and down_proj are zero),
    so a position's logits depend on its own token only; the LM head maps the MASK embedding's
    final hidden state ``h`` onto ``mask_logits`` (rows ``a_j * h / |h|^2``). Stop ids: none."""
    import torch

    from simsd.models.config import ModelConfig
    from simsd.models.loading import Checkpoint
    from simsd.models.model import SDARForCausalLM
    from simsd.testing import config_dict, random_state_dict

    logits = torch.as_tensor(mask_logits, dtype=torch.float64)
    cfg = config_dict(vocab_size=logits.shape[0], hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, mask_token_id=mask_id)
    sd = random_state_dict(cfg, seed=seed)
    for k in sd:
        if k.endswith("o_proj.weight") or k.endswith("down_proj.weight"):
            sd[k].zero_()
    model = SDARForCausalLM(ModelConfig.from_dict(cfg))
    model.load_state_dict(sd)
    model = model.double().eval()
    with torch.no_grad():
        h = model.model.norm(model.model.embed_tokens.weight[mask_id][None])[0]
        model.lm_head.weight.copy_(logits[:, None] * h[None] / (h @ h))
    return Checkpoint(None, model, None, mask_id, [])


def layout_tensors(ids, positions, labels, taus=None) -> tuple:
    """A verification layout (:func:`simsd.decoding.layouts.exact_layout` or
    ``paper_layout``: device ids, host positions and labels, device tau labels) as the inputs of
    a direct model call: ``ids, positions (1, L)`` and ``labels (1, L, 3)`` int32."""
    import torch
    lab = torch.tensor([labels], dtype=torch.int32, device=ids.device)
    if taus is not None:
        lab[0, :, 1] += taus
    return ids[None], torch.tensor([list(positions)], device=ids.device), lab


def load_bench_script(name: str):
    """``bench/<name>.py`` imported as a module (its neighbour ``bench/benchlib.py`` importable
    while it loads)."""
    import importlib.util
    import sys

    bench = Path(__file__).resolve().parents[1] / "bench"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location(name, bench / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(bench))
    return mod


def exp_noise(shape, g: torch.Generator) -> torch.Tensor:
    """``Exp(1)`` draws (float32) from a seeded generator: the noise of
    :func:`simsd.decoding.sampling.draw` for tests of the distributions themselves."""
    return torch.empty(shape, dtype=torch.float32).exponential_(generator=g)


def rejection_rng(n: int, vocab: int, g: torch.Generator) -> tuple:
    """The ``(u (n,), noise (n, vocab))`` of :func:`simsd.speculative.verification.token_verdicts`
    from a seeded generator (tests of the rejection sampling law over many draws)."""
    return torch.rand(n, generator=g, dtype=torch.float64), exp_noise((n, vocab), g)


@functools.lru_cache(maxsize=None)
def float16_overflow_checkpoint(name: str = "overflow", seed: int = 0) -> Path:
    """A random SDAR checkpoint (with tokenizer) whose logits reach ~1e5: finite in float32 and
    bfloat16 (float32's range), infinite in float16 (largest finite value 65504). Its LM head is
    a random checkpoint's scaled by 1e5."""
    import json

    from safetensors.torch import load_file, save_file
    path = _ROOT / f"{name}-{seed}"
    if not (path / "config.json").exists():
        make_random_checkpoint(path, seed=seed)
        weights = load_file(str(path / "model.safetensors"))
        weights["lm_head.weight"] = weights["lm_head.weight"] * 1e5
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        json.loads((path / "config.json").read_text())  # still a readable checkpoint
    return path
