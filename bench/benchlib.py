"""What ``bench_host.py`` and ``bench_reference.py`` share: checkpoints, prompts, the environment.

* :func:`bundled_pair` / :func:`random_checkpoint`: the bundled tiny pair, or a random SDAR
  checkpoint (``simsd.testing``) that carries the bundled tokenizer (so that the same prompt
  texts give the same ids, mask id and stop ids on every checkpoint).
* :func:`prompt_ids`: the first ``n`` bundled held-out prompts through the chat template
  (as ``simsd generate`` sends a text prompt by default).
* :func:`environment`: torch, transformers, python, git sha, threads (stamped on every row).

Both scripts use simsd's public API only (``simsd.load_checkpoint``, the batch functions,
``SDARForCausalLM`` as an ``nn.Module``), so they keep working when the decoding loop's
internals change.
"""
from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its thread pool

import torch  # noqa: E402

from simsd import load_checkpoint  # noqa: E402
from simsd.assets import DEFAULT_DRAFT, DEFAULT_TARGET, HELDOUT_PROMPTS  # noqa: E402
from simsd.entrypoints.bench import git_sha  # noqa: E402
from simsd.testing import config_dict, moe_config_dict, random_state_dict, save_checkpoint  # noqa: E402

#: the random checkpoints' shapes (the bundled tokenizer's vocabulary of 6144 ids)
RANDOM_SHAPES = {
    # 8 layers, head_dim 128: a forward that is not trivial on one CPU thread (38M parameters; 113M)
    "h512-l8-d128": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=128),
    "h1024-l8-d128": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=8,
                          num_key_value_heads=4, head_dim=128),
    # a mixture-of-experts target of the bundled target's attention shape: 64 experts of width 128,
    # 8 routed per token (the 30B-A3B ratios: 128 experts, 8 routed, expert width 3/8 of hidden)
    "moe-h256-l4-e64": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64,
                            moe=dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=96,
                                     norm_topk_prob=True)),
    # a draft for the speculative modes on a random target (5M parameters)
    "h256-l2-d128": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=128),
}


def set_threads(n: int) -> None:
    """torch's intra-op threads (the benchmarks' figures are for one thread unless told)."""
    torch.set_num_threads(n)


def bundled_pair(dtype: str = "float32"):
    """``(target, draft)`` :class:`simsd.Checkpoint` of the bundled tiny pair on the CPU."""
    return load_checkpoint(DEFAULT_TARGET, dtype=dtype), load_checkpoint(DEFAULT_DRAFT, dtype=dtype)


def random_checkpoint(path, shape: str, seed: int = 0, logit_scale: float = 0.15) -> Path:
    """Write a random SDAR (or SDAR-MoE: a shape with ``moe`` fields) checkpoint of
    ``RANDOM_SHAPES[shape]`` to ``path`` with the bundled
    target's tokenizer, vocabulary, mask id, stop ids and block size; float32 weights
    (:func:`simsd.testing.random_state_dict`, seed ``seed``). ``logit_scale`` multiplies
    ``lm_head`` (whose random rows have std 1) so that the logits are spread like a trained
    model's, not one-hot: greedy decoding then ranks real confidences, not ties at 1.0."""
    src = json.loads((DEFAULT_TARGET / "config.json").read_text())
    tok = load_checkpoint(DEFAULT_TARGET, with_tokenizer=True).tokenizer
    stops = json.loads((DEFAULT_TARGET / "generation_config.json").read_text()).get("eos_token_id")
    shape = dict(RANDOM_SHAPES[shape])
    moe = shape.pop("moe", None)
    cfg = config_dict(vocab_size=src["vocab_size"], block_size=src["block_size"], mask_token_id=src["mask_token_id"],
                      eos_token_id=src["eos_token_id"], **shape)
    if moe is not None:
        cfg = moe_config_dict(cfg, **moe)
    sd = random_state_dict(cfg, seed=seed, std=0.05)
    sd["lm_head.weight"] = sd["lm_head.weight"] * logit_scale
    return save_checkpoint(path, cfg, sd, tok, stop_ids=stops if isinstance(stops, list) else [stops])


def prompt_ids(tokenizer, n: int) -> tuple[list, list]:
    """``(ids, names)`` of the first ``n`` bundled held-out prompts as one user message each
    through the tokenizer's chat template with the generation prompt (what ``simsd generate``
    sends for a text prompt).

    Raises:
        ValueError: ``n`` outside ``[1, number of bundled prompts]``."""
    prompts = [json.loads(line) for line in HELDOUT_PROMPTS.read_text().splitlines() if line.strip()]
    if not 1 <= n <= len(prompts):
        raise ValueError(f"--prompts must be in [1, {len(prompts)}] (the bundled held-out prompts), got {n}")
    ids = []
    for p in prompts[:n]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}], tokenize=False,
                                             add_generation_prompt=True)
        ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids, [p["id"] for p in prompts[:n]]


def held_out_ids(n: int = 8) -> list:
    """The first ``n`` bundled held-out prompts' ids (:func:`prompt_ids` with the bundled target's
    tokenizer), concatenated: a stream of real tokens for workloads that cut their own prompts."""
    ids, _ = prompt_ids(load_checkpoint(DEFAULT_TARGET).tokenizer, n)
    return [i for p in ids for i in p]


def environment() -> dict:
    import transformers
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "git_sha": git_sha(), "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "load_average_1min": os.getloadavg()[0]}


def write_json(path, meta: dict, rows: list) -> None:
    Path(path).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
