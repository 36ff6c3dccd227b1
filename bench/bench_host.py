"""Host work per forward: aten ops outside and inside the model forwards, thread CPU time outside.

    python bench/bench_host.py [--modes vanilla,paper,exact] [--checkpoint bundled|random]
        [--prompts 3] [--max-new-tokens 64] [--temperature 0] [--repeats 3] [--top N] [--json F]

Per mode, one generate call decodes the prompts together (the public batch functions
``simsd.decoding.vanilla.vanilla_generate_batch`` / ``simsd.speculative.decoder.speculative_generate_batch``,
``--batch-size`` rows per call, default all prompts) after one untimed warm-up call. Which code
runs is told apart by forward pre/post hooks on the model instances (``SDARForCausalLM`` is an
``nn.Module`` called as ``model(...)``): while a target or draft forward runs, the work is
*inside* that model; everything else the generate call does (engine and cache set-up, building
each forward's inputs, sampling, remasking, verification, the host reads) is *outside*.

* **aten ops**: every op that reaches a ``TorchDispatchMode`` over the whole call (one
  counted call, after the warm-up): views, ``detach``, in-place and ``copy_`` ops count like any
  other op (the rows' ``views_*`` fields say how many were views); composite ops arrive decomposed (e.g.
  ``F.linear`` of a 3-D input as ``view``, ``t``, ``mm``, ``_unsafe_view``). ``out/fwd``: ops outside the models per
  target forward; ``out/any``: the same per forward of either model (target or draft);
  ``tgt in/fwd``: ops inside the target per target forward; ``per layer``:
  ``tgt in/fwd / num_hidden_layers`` (the whole forward: embedding, final norm, ``lm_head`` and
  the cache update included); ``layer ops``: ops inside the decoder layer modules per layer
  call, counted by hooks on ``model.model.layers[i]`` (the Qwen3 module path that the
  checkpoints' parameter names fix; ``-`` when those modules are not called); ``dft in/fwd``,
  ``dft in/tgt``: ops inside the draft per draft forward and per target forward. Target
  forwards include the prefill forward of each prompt (one per prompt with at least a block of
  tokens).
* **thread CPU time** (``time.thread_time``, the calling thread; decoding runs on it): the
  generate call's time minus the time inside the model forwards, per target forward
  (``out ms/fwd``) and per forward of either model (``out ms/any``), median of ``--repeats``
  calls run without the dispatch mode (which would slow the host down); ``fwd ms``: CPU time
  inside the target per target forward, for scale.

Defaults reproduce the issue 24 setting: the bundled pair, the first 3 bundled held-out prompts
(chat template) x 64 new tokens, greedy, static strategy, B = 4, float32, one thread.
``--checkpoint random`` runs a random 8-layer head_dim-128 target (``h512-l8-d128``) with a
random 2-layer draft (``bench/benchlib.py``). ``--top N`` also lists the N most frequent ops
outside the models and inside the target, per target forward (the rows hold them all).
``--json F`` writes the rows.

``--layer`` counts instead the aten ops of one decoder layer call of a one-row, four-token
forward (a denoise forward over a cache of 20 tokens, the checkpoint's config), with the same
dispatch mode: ``real``: on this build's CPU with the attention backend the model resolves (the
torch backend's RoPE, cache write and SDPA calls counted op by op); ``fake:<device>``: on fake
tensors of ``<device>`` (no memory, no GPU: ``torch._subclasses.FakeTensorMode``) with the
attention as the door's one op ``simsd::attention_with_kvcache`` (what the CUDA backend
launches), so that the rest of the layer is counted as that build dispatches it (e.g.
``--layer-devices cpu,cuda`` on a CUDA build of torch, where ``F.rms_norm`` is the one op
``aten::_fused_rms_norm``). Columns: ops, views, not views (the launches on a GPU).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import benchlib  # noqa: E402
from simsd import DecodeConfig, SamplingParams, SpecConfig, load_checkpoint  # noqa: E402
from simsd.decoding.vanilla import vanilla_generate_batch  # noqa: E402
from simsd.speculative.decoder import speculative_generate_batch  # noqa: E402

MODES = ("vanilla", "paper", "exact")
OUTSIDE = "outside"


class Probe:
    """Hooks on the models that say where the calling thread is (``outside`` or a model's
    name), count forwards and ops per place, and sum the thread CPU time inside each model.

    Raises (from a hook):
        RuntimeError: a model forward that starts inside another one (the split would be wrong).
    """

    def __init__(self, models: dict):
        self.where = OUTSIDE
        self.in_layer = False
        self.forwards, self.ops, self.views, self.cpu = Counter(), Counter(), Counter(), Counter()
        self.layer_calls, self.layer_ops = Counter(), Counter()
        self.by_op = Counter()  # (place, op name) -> count
        self._t0 = 0.0
        self.handles = []
        for name, model in models.items():
            self.handles.append(model.register_forward_pre_hook(partial(self._enter, name)))
            self.handles.append(model.register_forward_hook(partial(self._leave, name)))
            layers = getattr(getattr(model, "model", None), "layers", None)
            for layer in layers if isinstance(layers, torch.nn.ModuleList) else ():
                self.handles.append(layer.register_forward_pre_hook(partial(self._enter_layer, name)))
                self.handles.append(layer.register_forward_hook(self._leave_layer))

    def reset(self) -> None:
        for c in (self.forwards, self.ops, self.views, self.cpu, self.layer_calls, self.layer_ops, self.by_op):
            c.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def _enter(self, name, module, args):
        if self.where != OUTSIDE:
            raise RuntimeError(f"a {name} forward started inside a {self.where} forward")
        self.where = name
        self.forwards[name] += 1
        self._t0 = time.thread_time()

    def _leave(self, name, module, args, output):
        self.cpu[name] += time.thread_time() - self._t0
        self.where = OUTSIDE

    def _enter_layer(self, name, module, args):
        self.in_layer = True
        self.layer_calls[name] += 1

    def _leave_layer(self, module, args, output):
        self.in_layer = False

    def count(self, func) -> None:
        self.ops[self.where] += 1
        self.views[self.where] += int(func.is_view)
        if self.in_layer:
            self.layer_ops[self.where] += 1
        self.by_op[self.where, func.__name__] += 1


class CountOps(TorchDispatchMode):
    """Counts every aten op dispatched while it is active into ``probe``."""

    def __init__(self, probe: Probe):
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.probe.count(func)
        return func(*args, **(kwargs or {}))


class LayerOps(TorchDispatchMode):
    """Records the ops dispatched while ``on`` (set by hooks on one decoder layer)."""

    def __init__(self):
        super().__init__()
        self.ops, self.on = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on and func.namespace != "prim":  # prim.device: fake-tensor bookkeeping
            self.ops.append(func)
        return func(*args, **(kwargs or {}))


def layer_ops(model, device: str | None = None) -> dict:
    """The ops of ``model.model.layers[0]`` in a one-row four-token denoise forward over a cache
    of 20 tokens: ``device`` None runs ``model`` itself; a device name runs a copy of its config on
    fake tensors of that device, the attention as the door's one custom op (module doc)."""
    from contextlib import ExitStack
    from unittest import mock

    from torch._subclasses.fake_tensor import FakeTensorMode

    from simsd.models.model import SDARForCausalLM
    with ExitStack() as stack:
        dev = model.device if device is None else torch.device(device)
        if device is not None:
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            # prepare_attention then returns the door whose forward is the one op (as when compiling)
            stack.enter_context(mock.patch.object(torch.compiler, "is_compiling", lambda: True))
            stack.enter_context(mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: False))
            with torch.device("meta"):
                fake = SDARForCausalLM(model.config)
            for mod in fake.modules():
                for name, p in [(n, q) for n, q in mod._parameters.items() if q is not None]:
                    mod._parameters[name] = torch.nn.Parameter(torch.ones(p.shape, dtype=model.dtype, device=dev),
                                                               requires_grad=False)
            model = fake
        count = LayerOps()
        layer = model.model.layers[0]
        hooks = [layer.register_forward_pre_hook(lambda *a: setattr(count, "on", True)),
                 layer.register_forward_hook(lambda *a: setattr(count, "on", False))]
        cache = model.new_cache(1, 64)
        cache.check_lengths = False
        ids = torch.zeros(1, 20, dtype=torch.int64, device=dev)
        labels = torch.zeros(1, 20, 3, dtype=torch.int32, device=dev)
        model(ids, torch.arange(20, device=dev)[None], labels, "block_causal", cache, 20, None)
        args = (ids[:, :4], torch.arange(20, 24, device=dev)[None], labels[:, :4], "bidirectional", cache, 0)
        model(*args)  # warm-up (the merged norm weights are made once)
        with count:
            model(*args)
        for h in hooks:
            h.remove()
    views = sum(f.is_view for f in count.ops)
    return {"layer_count": "real" if device is None else f"fake:{device}", "torch": torch.__version__,
            "layer_ops": len(count.ops), "layer_views": views, "layer_not_views": len(count.ops) - views,
            "layer_op_list": [f"{f.namespace}::{f.__name__}" for f in count.ops]}


def generate(mode: str, target, draft, prompts: list, cfg: DecodeConfig, batch_size: int) -> list:
    """Decode ``prompts`` in ``mode`` with simsd's public batch functions; the token ids per prompt."""
    out = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        if mode == "vanilla":
            res = vanilla_generate_batch(target.model, chunk, cfg, target.mask_token_id, target.stop_ids, i)
        else:
            res = speculative_generate_batch(target, draft, chunk, cfg, SpecConfig(mode=mode), i)
        out += [r.token_ids for r in res.results]
    return out


def measure(mode: str, target, draft, prompts: list, cfg: DecodeConfig, batch_size: int, repeats: int) -> dict:
    """One mode's row: a warm-up call, a counted call, ``repeats`` timed calls."""
    models = {"target": target.model} if mode == "vanilla" else {"target": target.model, "draft": draft.model}
    probe = Probe(models)
    try:
        tokens = generate(mode, target, draft, prompts, cfg, batch_size)  # warm-up, untimed
        probe.reset()
        with CountOps(probe):
            counted = generate(mode, target, draft, prompts, cfg, batch_size)
        if counted != tokens:
            raise RuntimeError(f"{mode}: the counted call decoded other tokens than the warm-up call")
        ops, views, fwd = dict(probe.ops), dict(probe.views), dict(probe.forwards)
        layer_calls, layer_ops = dict(probe.layer_calls), dict(probe.layer_ops)
        by_op = Counter(probe.by_op)
        outside_ms, inside_ms = [], []
        for _ in range(repeats):
            probe.reset()
            t0 = time.thread_time()
            generate(mode, target, draft, prompts, cfg, batch_size)
            total = time.thread_time() - t0
            if dict(probe.forwards) != fwd:
                raise RuntimeError(f"{mode}: a timed call ran other forwards than the counted call")
            outside_ms.append(1e3 * (total - sum(probe.cpu.values())) / fwd["target"])
            inside_ms.append(1e3 * probe.cpu["target"] / fwd["target"])
    finally:
        probe.remove()
    n_t, n_d = fwd.get("target", 0), fwd.get("draft", 0)
    layers = target.model.config.num_hidden_layers
    row = {
        "mode": mode, "prompts": len(prompts), "new_tokens": sum(len(t) for t in tokens),
        "target_forwards": n_t, "draft_forwards": n_d,
        "ops_outside": ops.get(OUTSIDE, 0), "views_outside": views.get(OUTSIDE, 0),
        "ops_outside_per_target_forward": ops.get(OUTSIDE, 0) / n_t,
        "ops_outside_per_forward": ops.get(OUTSIDE, 0) / (n_t + n_d),
        "ops_in_target_per_target_forward": ops.get("target", 0) / n_t,
        "ops_in_target_per_layer": ops.get("target", 0) / n_t / layers,
        "ops_in_layer_modules_per_layer_call": (layer_ops.get("target", 0) / layer_calls["target"]
                                                if layer_calls.get("target") else None),
        "views_in_target_per_target_forward": views.get("target", 0) / n_t,
        "ops_in_draft_per_draft_forward": ops.get("draft", 0) / n_d if n_d else None,
        "ops_in_draft_per_target_forward": ops.get("draft", 0) / n_t if n_d else None,
        "cpu_ms_outside_per_target_forward": statistics.median(outside_ms),
        "cpu_ms_outside_per_target_forward_all": outside_ms,
        "cpu_ms_outside_per_forward": statistics.median(outside_ms) * n_t / (n_t + n_d),
        "cpu_ms_in_target_per_target_forward": statistics.median(inside_ms),
        "num_hidden_layers": layers,
        # per target forward: the most frequent ops outside the models and inside the target
        "top_ops_outside": {op: n / n_t for (where, op), n in by_op.most_common() if where == OUTSIDE},
        "top_ops_in_target": {op: n / n_t for (where, op), n in by_op.most_common() if where == "target"},
    }
    return row


#: the table's columns: (header, row key, width, decimals)
COLUMNS = [("tgt fwd", "target_forwards", 7, 0), ("dft fwd", "draft_forwards", 7, 0),
           ("out/fwd", "ops_outside_per_target_forward", 8, 1), ("out/any", "ops_outside_per_forward", 8, 1),
           ("tgt in/fwd", "ops_in_target_per_target_forward", 10, 1), ("per layer", "ops_in_target_per_layer", 9, 1),
           ("layer ops", "ops_in_layer_modules_per_layer_call", 9, 1),
           ("dft in/fwd", "ops_in_draft_per_draft_forward", 10, 1),
           ("dft in/tgt", "ops_in_draft_per_target_forward", 10, 1),
           ("out ms/fwd", "cpu_ms_outside_per_target_forward", 10, 3),
           ("out ms/any", "cpu_ms_outside_per_forward", 10, 3), ("fwd ms", "cpu_ms_in_target_per_target_forward", 7, 3)]


def print_table(rows: list, title: str) -> None:
    print(title)
    print(f"{'mode':8} " + " ".join(f"{h:>{w}}" for h, _, w, _ in COLUMNS))
    for r in rows:
        cells = ["-".rjust(w) if r[k] is None else f"{r[k]:{w}.{d}f}" for _, k, w, d in COLUMNS]
        print(f"{r['mode']:8} " + " ".join(cells))
    print("out/fwd: aten ops outside the model forwards per target forward (views, detach, copies included); "
          "out/any: the same per forward of either model; tgt in/fwd: ops inside the target per target forward; "
          "per layer: tgt in/fwd / num_hidden_layers; layer ops: ops inside a decoder layer module per call; "
          "dft in/fwd, dft in/tgt: ops inside the draft per draft / per target forward; out ms/fwd, out ms/any: "
          "thread CPU ms outside the forwards per target forward / per forward of either model (median); "
          "fwd ms: thread CPU ms inside the target per target forward")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: vanilla, paper, exact")
    p.add_argument("--checkpoint", choices=("bundled", "random"), default="bundled")
    p.add_argument("--prompts", type=int, default=3, help="the first N bundled held-out prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--block-length", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=None, help="rows per generate call (default: all prompts)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per mode (median)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--top", type=int, default=0, help="also list the N most frequent ops outside and inside")
    p.add_argument("--json", default=None, help="write the rows to this file")
    p.add_argument("--layer", action="store_true", help="count the ops of one decoder layer instead (module doc)")
    p.add_argument("--layer-devices", default="cpu", help="fake-tensor devices for --layer (e.g. cpu,cuda)")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        p.error(f"--modes: unknown mode(s) {bad} (choose from {', '.join(MODES)})")
    for name in ("prompts", "max_new_tokens", "repeats", "threads", "block_length"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.batch_size is not None and args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.temperature < 0:
        p.error(f"--temperature must be >= 0, got {args.temperature}")
    return args


def load_models(kind: str, tmp: Path) -> tuple:
    """``(target, draft, description)``: the bundled pair, or random checkpoints written under ``tmp``."""
    if kind == "bundled":
        return (*benchlib.bundled_pair(), "bundled tiny pair")
    target = load_checkpoint(benchlib.random_checkpoint(tmp / "target", "h512-l8-d128"))
    draft = load_checkpoint(benchlib.random_checkpoint(tmp / "draft", "h256-l2-d128", seed=1))
    return target, draft, "random h512-l8-d128 target, h256-l2-d128 draft"


def main(argv=None) -> int:
    args = parse_args(argv)
    benchlib.set_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        target, draft, name = load_models(args.checkpoint, Path(tmp))
    if args.layer:
        rows = [layer_ops(target.model)] + [layer_ops(target.model, d.strip())
                                            for d in args.layer_devices.split(",") if d.strip()]
        print(f"bench_host --layer: {name}, one decoder layer of a 1-row 4-token forward, float32")
        print(f"{'count':<12} {'torch':<16} {'ops':>5} {'views':>6} {'not views':>10}")
        for r in rows:
            print(f"{r['layer_count']:<12} {r['torch']:<16} {r['layer_ops']:>5} {r['layer_views']:>6} "
                  f"{r['layer_not_views']:>10}")
        if args.json:
            benchlib.write_json(args.json, {"script": "bench_host --layer", **vars(args)}, rows)
        return 0
    prompts, names = benchlib.prompt_ids(target.tokenizer, args.prompts)
    cfg = DecodeConfig(block_length=args.block_length, strategy="static", max_new_tokens=args.max_new_tokens,
                       sampling=SamplingParams(temperature=args.temperature))
    batch = args.batch_size or len(prompts)
    env = benchlib.environment()
    rows = []
    for mode in args.modes:
        row = measure(mode, target, draft, prompts, cfg, batch, args.repeats)
        row.update(checkpoint=args.checkpoint, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                   block_length=args.block_length, batch_size=batch, dtype="float32", **env)
        rows.append(row)
    print_table(rows, f"bench_host: {name}, {len(prompts)} prompts x {args.max_new_tokens} tokens, "
                      f"{'greedy' if cfg.sampling.greedy else f'temperature {args.temperature}'}, static, "
                      f"B={args.block_length}, float32, {env['threads']} thread(s), {batch} rows per call, "
                      f"torch {env['torch']}, git {env['git_sha']}")
    for r in rows if args.top else ():
        for where in ("outside", "in_target"):
            top = list(r[f"top_ops_{where}"].items())[:args.top]
            print(f"{r['mode']}: most frequent ops {where.replace('_', ' ')} per target forward: "
                  + ", ".join(f"{op} {n:.1f}" for op, n in top))
    if args.json:
        benchlib.write_json(args.json, {"script": "bench_host", "prompt_ids": names, **vars(args)}, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
