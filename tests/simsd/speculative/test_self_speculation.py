"""Self-speculation (``draft="self"``, :mod:`simsd.speculative.self_draft`): the target proposes its
own next steps from its verify logits, and exact verification keeps vanilla's tokens -- greedy
and sampled, float32 and bfloat16, every strategy, batches, mid-block rounds, folded commits,
multi-token steps, fallback steps, MoE targets -- with no draft model and no draft forward.

The targets run with ``invariant`` numerics, so that a verify copy's logits are a denoise
forward's bits (tests/simsd/models/test_invariant_numerics.py).
"""
import dataclasses

import pytest

from simsd import DecodeConfig, SamplingParams
from simsd.config.speculative import ALTERNATIVES, NGRAM
from simsd.config.vocabulary import ParamError
from simsd.decoding.vanilla import vanilla_generate_batch
from simsd.speculative import SpecConfig, SpeculativeDecoder, speculative_generate, speculative_generate_batch
from tests.simsd.speculative.test_exact_sampling import (
    PATH_VARIANTS,
    PROMPTS,
    THRESHOLD,
    bundled_pair,
    ckpt,
    vanilla_ids,
)

STRATEGIES = ["static", "sequential", "dynamic", "entropy"]
#: a fixed width: the trees then depend on the tokens and the acceptance seen only, never on how
#: long this machine takes ("auto" weighs timings; the tokens are vanilla's either way)
WIDTH = 7


def spec(**kw):
    return SpecConfig(**{"mode": "exact", "speculation_width": WIDTH, **kw})


@pytest.fixture(scope="module")
def target():
    return ckpt("target")


def cfg_for(strategy, T, seed=0, **kw):
    top = dict(top_k=40, top_p=0.95) if T else {}
    return DecodeConfig(block_length=kw.pop("block_length", 4), strategy=strategy, threshold=THRESHOLD.get(strategy),
                        max_new_tokens=kw.pop("max_new_tokens", 20), seed=seed,
                        sampling=SamplingParams(temperature=T, **top), **kw)


@pytest.mark.parametrize("T", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_self_speculation_equals_vanilla(target, strategy, T):
    """Token-identical to vanilla decoding with the same seed, with the width policy's trees and
    with full-depth chains (gamma proposed steps every round, whatever they are worth), where
    proposals are accepted and rejected somewhere (both verdict paths run); no draft forward."""
    accepted = proposed = lookaheads = 0
    for i, prompt in enumerate(PROMPTS):
        cfg = cfg_for(strategy, T, seed=i)
        want = vanilla_ids(target, prompt, cfg)
        got = speculative_generate(target, "self", prompt, cfg, spec())
        assert got.token_ids == want, i
        chains = SpeculativeDecoder(target, "self", cfg, spec())
        chains.verifier_class = with_alternatives(0)
        full = chains.generate(prompt)
        assert full.token_ids == want, i
        for r in (got, full):  # every target forward is a round or a commit (each block but the last,
            assert r.stats["draft_forwards"] == 0  # unless a lookahead round committed it)
            st = r.stats
            assert st["target_forwards"] == st["rounds"] + st["blocks"] - 1 - st["lookahead_commits"]
        lookaheads += got.stats["lookahead_blocks"]
        accepted += full.stats["accepted"]
        proposed += full.stats["proposed"]
    assert 0 < accepted < proposed, (accepted, proposed)


@pytest.mark.parametrize("T", [0.0, 1.0])
def test_self_speculation_in_bfloat16(T):
    """bfloat16 weights and activations (the GPU default), greedy and sampled."""
    target = ckpt("target", dtype="bfloat16")
    for strategy in ("static", "dynamic"):
        for i, prompt in enumerate(PROMPTS):
            cfg = cfg_for(strategy, T, seed=20 + i)
            got = speculative_generate(target, "self", prompt, cfg, spec())
            assert got.token_ids == vanilla_ids(target, prompt, cfg), (strategy, i)


@pytest.mark.parametrize("variant", ["gamma2", "gamma1", "fallback", "fold", "b8_steps4", "moe"])
def test_self_speculation_paths(target, variant):
    """Rounds that start mid-block (gamma 2: at most two proposed steps), one proposal a round
    (gamma 1), the target finishing a block (fallback), folded commits, multi-token steps (B = 8
    in 4 steps) and a mixture-of-experts target: still vanilla's tokens."""
    kw, extra = PATH_VARIANTS[variant]
    if variant == "moe":
        from tests.simsd.speculative.test_moe_modes import MOE
        target = ckpt("moe-target", moe=MOE)
    for i, prompt in enumerate(PROMPTS):
        for T in (0.0, 1.0):
            cfg = cfg_for("static", T, seed=10 + i, **kw)
            got = speculative_generate(target, "self", prompt, cfg, spec(**extra))
            assert got.token_ids == vanilla_ids(target, prompt, cfg), (i, T)
            if variant == "fallback":
                assert got.stats["fallback_steps"] > 0


def test_self_speculation_batch_equals_vanilla_batch(target):
    """Rows with independent progress keep their own kept logits and noise: the batch equals
    vanilla's batch, and single runs with seed + i."""
    cfg = cfg_for("static", 1.0, seed=4)
    want = vanilla_generate_batch(target.model, PROMPTS, cfg, target.mask_token_id, [])
    got = speculative_generate_batch(target, "self", PROMPTS, cfg, spec())
    assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results]
    assert got.stats["batched_forwards"].keys() == {"target"}
    for i, p in enumerate(PROMPTS):
        assert got.results[i].token_ids == vanilla_ids(target, p, dataclasses.replace(cfg, seed=cfg.seed + i))


def test_bundled_target_speculates_on_itself_with_fewer_forwards():
    """The bundled (trained) target in bfloat16: vanilla's tokens, and fewer target forwards per
    token than vanilla, greedy and sampled."""
    from simsd.entrypoints.prompts import load_prompts
    target, _ = bundled_pair("bfloat16")
    tok = target.tokenizer
    prompts = [tok(p.text, add_special_tokens=False)["input_ids"] for p in load_prompts("bundled")[:3]]
    for T in (0.0, 1.0):
        cfg = DecodeConfig(block_length=4, max_new_tokens=32, seed=7, sampling=SamplingParams(temperature=T))
        want = vanilla_generate_batch(target.model, prompts, cfg, target.mask_token_id, target.stop_ids)
        got = speculative_generate_batch(target, "self", prompts, cfg, spec())
        assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results], T
        forwards = [sum(r.stats["target_forwards"] for r in b.results) for b in (got, want)]
        assert forwards[0] < forwards[1], (T, forwards)


@pytest.mark.parametrize("spec,param", [
    (dict(mode="paper", paper_variant="release"), "paper_variant"),
    (dict(mode="exact", optimistic=True), "optimistic"),
    (dict(mode="exact", draft_strategy="sequential"), "draft_strategy"),
    (dict(mode="exact", draft_threshold=0.5), "draft_threshold"),
])
def test_self_speculation_refuses_what_it_cannot_use(target, spec, param):
    cfg = DecodeConfig(block_length=4, max_new_tokens=8)
    with pytest.raises(ParamError, match="self") as err:
        SpeculativeDecoder(target, "self", cfg, SpecConfig(**spec))
    assert err.value.param == param


def test_command_line_and_api_take_draft_self(capsys):
    """``simsd generate --draft self`` and ``LLM(draft="self")``: vanilla's tokens, no draft
    model loaded, no draft forward; ``./self`` stays a path (a checkpoint directory named self)."""
    import json

    from simsd import LLM
    from simsd.config.speculative import SELF_DRAFT, parse_draft
    from simsd.entrypoints.cli import main
    runs = {}
    for mode, extra in (("vanilla", []), ("exact", ["--draft", "self"])):
        assert main(["generate", "--mode", mode, "--max-tokens", "24", "--json", *extra]) == 0
        runs[mode] = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert runs["exact"]["token_ids"] == runs["vanilla"]["token_ids"]
    assert runs["exact"]["stats"]["draft_forwards"] == 0 and runs["exact"]["stats"]["rounds"] > 0
    llm = LLM(draft="self", batch_size=1, scheduler_thread=False)
    assert llm.draft is None and set(llm.engine.models) == {"target"}
    vanilla = LLM(mode="vanilla", batch_size=1, scheduler_thread=False)
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=5)
    assert llm.generate(["Once upon a time"], params)[0].token_ids == \
        vanilla.generate(["Once upon a time"], params)[0].token_ids
    # the auto width (the default) reads the engine's timings of its forwards; vanilla times none
    assert llm.engine.costs["target"].samples and not vanilla.engine.costs["target"].samples
    assert parse_draft("self") == SELF_DRAFT and str(parse_draft("./self")) == "self" and \
        not isinstance(parse_draft("./self"), str)


def test_bench_runs_exact_self_beside_exact(tmp_path, capsys):
    """``simsd bench --modes vanilla,exact,exact-self``: one column per way (the draft model only in
    ``exact``), every column vanilla's tokens; with no column needing it, no draft is loaded."""
    import json

    from simsd.entrypoints.cli import main
    out = tmp_path / "rows.json"
    assert main(["bench", "--modes", "vanilla,exact,exact-self", "--limit", "2", "--max-tokens", "24",
                 "--repeats", "1", "--warmup", "0", "--json", str(out)]) == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"vanilla", "exact", "exact-self"}
    assert all(r["identical_to_vanilla"] == 2 for r in rows.values())
    assert rows["exact-self"]["draft_forwards_per_token"] == 0 < rows["exact"]["draft_forwards_per_token"]
    assert rows["exact-self"]["target_query_tokens_per_forward"] > rows["vanilla"]["target_query_tokens_per_forward"]
    assert "and draft" in capsys.readouterr().err
    assert main(["bench", "--modes", "vanilla,exact-self", "--limit", "1", "--max-tokens", "8", "--repeats", "1",
                 "--warmup", "0"]) == 0
    assert "and draft" not in capsys.readouterr().err  # the loading line names the target only


def with_alternatives(n):
    """A decoder's verifier class proposing ``n`` alternatives beside each proposed step."""
    import functools

    from simsd.speculative.self_draft import SelfExactVerifier
    return functools.partial(SelfExactVerifier, alternatives=n)


@pytest.mark.parametrize("alternatives", [1, 2])
@pytest.mark.parametrize("T", [0.0, 1.0])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_proposal_trees_keep_vanilla_tokens(target, strategy, T, alternatives):
    """Alternatives beside each proposed step (the next most confident position, the next most
    likely token: siblings in the round's proposal tree) change no token, and accept at least
    what the plain chain of the same depth accepts."""
    runs = []
    for n in (alternatives, 0):
        dec = SpeculativeDecoder(target, "self", cfg_for(strategy, T), SpecConfig(mode="exact"))
        dec.verifier_class = with_alternatives(n)
        runs.append(dec.generate_batch(PROMPTS, seeds=[7, 8, 9]))
    got, plain = runs
    for i, prompt in enumerate(PROMPTS):
        want = vanilla_ids(target, prompt, cfg_for(strategy, T, seed=7 + i))
        assert got.results[i].token_ids == want == plain.results[i].token_ids, i
    assert sum(r.stats["accepted"] for r in got.results) >= sum(r.stats["accepted"] for r in plain.results)


def test_alternatives_save_target_forwards_on_the_bundled_target():
    from simsd.entrypoints.prompts import load_prompts
    target, _ = bundled_pair("float32")
    tok = target.tokenizer
    prompts = [tok(p.text, add_special_tokens=False)["input_ids"] for p in load_prompts("bundled")[:4]]
    cfg = DecodeConfig(block_length=4, max_new_tokens=48, fold_commit=True)
    forwards = []
    for n in (0, 2):
        dec = SpeculativeDecoder(target, "self", cfg, SpecConfig(mode="exact"))
        dec.verifier_class = with_alternatives(n)
        out = dec.generate_batch(prompts)
        forwards.append(sum(r.stats["target_forwards"] for r in out.results))
        assert [r.token_ids for r in out.results] == \
            [r.token_ids for r in vanilla_generate_batch(target.model, prompts, cfg, target.mask_token_id,
                                                          target.stop_ids).results]
    assert forwards[1] < forwards[0], forwards


@pytest.mark.parametrize("T", [0.0, 1.0])
def test_history_predictions_save_target_forwards_on_the_bundled_target(T):
    """The row's history's predictions (prompt lookup) beside the logits': the NGRAM kinds in the
    block's tree, and the next block's first steps under a finished block (a chain under its next
    block's copy). The bundled target repeats itself, and greedy, proposals of its history's
    tokens are the target's steps (valid nodes of those kinds, next blocks begun more than one
    step in), with fewer target forwards than without them; sampled, they are proposed.
    Vanilla's tokens either way."""
    from simsd.entrypoints.prompts import load_prompts
    from simsd.speculative.ngram import NgramIndex
    from simsd.speculative.self_draft import SelfDraft
    from simsd.speculative.width import WidthPolicy
    target, _ = bundled_pair("float32")
    tok = target.tokenizer
    prompts = [tok(p.text, add_special_tokens=False)["input_ids"] for p in load_prompts("bundled")[:4]]
    cfg = DecodeConfig(block_length=4, max_new_tokens=48, fold_commit=True, seed=5,
                       sampling=SamplingParams(temperature=T))
    want = [r.token_ids for r in vanilla_generate_batch(target.model, prompts, cfg, target.mask_token_id,
                                                        target.stop_ids).results]
    forwards, kinds = [], {"proposed": [], "valid": []}
    real, real_ahead, ahead = SelfDraft.observe, WidthPolicy.observe_ahead, []

    def observe(self, tree, node):
        if tree.kind is None:  # a round without logits: the history's steps alone
            kinds["proposed"].append((0, NGRAM))
            kinds["valid"] += [(0, NGRAM)] * node
            return real(self, tree, node)
        kinds["proposed"] += [ALTERNATIVES[k - 1] for k in tree.kind[1:] if k]
        j = node
        while j > 0:
            kinds["valid"].append(ALTERNATIVES[tree.kind[j] - 1] if tree.kind[j] else (0, 0))
            j = tree.parent[j]
        real(self, tree, node)
    for history in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(SelfDraft, "observe", observe)
            mp.setattr(WidthPolicy, "observe_ahead", lambda self, n, v: ahead.append((n, v)) or real_ahead(self, n, v))
            if not history:
                mp.setattr(NgramIndex, "fill", lambda self, block, mask_id, before=(): list(block))
            out = speculative_generate_batch(target, "self", prompts, cfg, spec(speculation_width=24))
        assert [r.token_ids for r in out.results] == want
        forwards.append(sum(r.stats["target_forwards"] for r in out.results))
        for r in out.results:  # the next blocks' predicted steps count as proposed and accepted tokens
            st = r.stats
            assert st["accepted"] + st["target_tokens"] == st["new_tokens"] + st["cut_tokens"]
            assert st["accepted"] <= st["proposed"] and st["from_draft"] <= min(st["accepted"], st["new_tokens"])
        assert any(rank == NGRAM for _, rank in kinds["proposed"]) == history
        assert any(n for n, _ in ahead) == history  # next blocks' steps proposed under a finished block
        if T == 0.0:
            assert any(rank == NGRAM for _, rank in kinds["valid"]) == history
            assert any(v for _, v in ahead) == history  # and taken
        kinds, ahead = {"proposed": [], "valid": []}, []
    if T == 0.0:
        assert forwards[0] < forwards[1], forwards


def test_self_speculation_on_the_triton_kernels():
    """The (interpreted, on a CPU) Triton backend: vanilla's tokens, greedy and sampled."""
    pytest.importorskip("triton")
    from simsd_kernels.backends import resolve_backend
    t = ckpt("target")
    try:
        resolve_backend("triton", t.model.device)
    except ValueError as exc:
        pytest.skip(str(exc))
    t.model.attention_backend = "triton"
    for T in (0.0, 1.0):
        cfg = cfg_for("static", T, seed=2, max_new_tokens=12)
        got = speculative_generate(t, "self", PROMPTS[0], cfg, spec())
        assert got.token_ids == vanilla_ids(t, PROMPTS[0], cfg), T
        assert got.stats["proposed"] > 0


def test_self_speculation_through_the_graph_runner(target, monkeypatch):
    """The graph engine's static shapes (every row, query lengths rounded to blocks: the trees'
    widths among them), with the CUDA capture replaced by eager replay: vanilla's tokens."""
    import simsd.engine.graphs
    monkeypatch.setattr(simsd.engine.graphs, "cuda_capture", simsd.engine.graphs.eager_capture)
    monkeypatch.setattr(simsd.engine.graphs, "check_graphable", lambda model: None)
    cfg = cfg_for("static", 1.0, seed=3)
    want = vanilla_generate_batch(target.model, PROMPTS, cfg, target.mask_token_id, []).results
    got = speculative_generate_batch(target, "self", PROMPTS, cfg, spec(), cuda_graphs=True)
    assert [r.token_ids for r in got.results] == [r.token_ids for r in want]
    assert sum(r.stats["accepted"] for r in got.results) > 0


@pytest.mark.parametrize("T", [0.0, 1.0])
def test_paper_mode_verifies_the_targets_previous_predictions(target, T):
    """Paper mode with ``draft="self"`` (the paper's self-speculative setting): a block's first
    round is a target step keeping its logits, later rounds verify a chain from the last round's
    M-slot predictions in the paper's layout; proposals are accepted, no draft forward runs, and a
    batch decodes each row as it decodes alone."""
    cfg = cfg_for("static", T, seed=5)
    sp = SpecConfig(mode="paper")
    alone = [speculative_generate(target, "self", p, dataclasses.replace(cfg, seed=cfg.seed + i), sp)
             for i, p in enumerate(PROMPTS)]
    batch = speculative_generate_batch(target, "self", PROMPTS, cfg, sp)
    assert [r.token_ids for r in batch.results] == [r.token_ids for r in alone]
    assert sum(r.stats["accepted"] for r in alone) > 0
    for r in alone:
        assert r.stats["draft_forwards"] == 0 and len(r.token_ids) == cfg.max_new_tokens
        assert r.stats["accepted"] + r.stats["target_tokens"] == r.stats["new_tokens"] + r.stats["cut_tokens"]


def test_lookahead_commits_or_rolls_back(target, monkeypatch):
    """A lookahead round writes its first proposed finished block and takes the next block's first
    step under each: kept when the block finished so (``lookahead_commits``), rolled back
    otherwise, and when another proposed finished block was the target's the next block is begun
    and that block committed as any other (``lookahead_blocks`` counts both); all of it happens
    here, greedy and sampled, folded commits or not, and the tokens stay vanilla's."""
    from simsd.engine.batching import Row
    rollbacks = []
    real = Row.truncate
    monkeypatch.setattr(Row, "truncate", lambda self, model, n: (rollbacks.append(model), real(self, model, n))[1])
    for fold in (False, True):
        written = other = 0
        for T in (0.0, 1.0):
            cfg = cfg_for("static", T, seed=1, fold_commit=fold, max_new_tokens=48)
            got = speculative_generate_batch(target, "self", PROMPTS, cfg, spec(speculation_width=24))
            for i, p in enumerate(PROMPTS):
                assert got.results[i].token_ids == vanilla_ids(target, p, dataclasses.replace(cfg, seed=1 + i))
            written += sum(r.stats["lookahead_commits"] for r in got.results)
            other += sum(r.stats["lookahead_blocks"] - r.stats["lookahead_commits"] for r in got.results)
        assert written > 0 and other > 0, (fold, written, other)
    assert rollbacks and set(rollbacks) == {"target"}


def test_a_block_filled_by_its_lookahead_step_after_an_unwritten_finish(target, monkeypatch):
    """A lookahead's next block can be finished by its first step (here: the entropy strategy with
    a bound that reveals a whole block at once). When the finished block the round took was not
    the one it wrote, that block's folded commit is still pending: it goes first, as a forward of
    its own, then the next block's (they cannot share one). Vanilla's tokens."""
    from simsd.decoding.layouts import RowLayouts
    flushed = []
    real = RowLayouts.flush
    monkeypatch.setattr(RowLayouts, "flush", lambda self, model: flushed.append(real(self, model)) or flushed[-1])
    cfg = dataclasses.replace(cfg_for("entropy", 0.0, seed=3, fold_commit=True, max_new_tokens=48), threshold=3.0)
    got = speculative_generate_batch(target, "self", PROMPTS, cfg, spec(speculation_width=24))
    for i, p in enumerate(PROMPTS):
        assert got.results[i].token_ids == vanilla_ids(target, p, dataclasses.replace(cfg, seed=3 + i))
    assert any(f is not None for f in flushed)


def test_a_block_without_a_lookahead_proposes_from_the_rolled_back_one():
    """When a lookahead's finished block was not the target's, the next block's predictions that
    its copy computed are kept (``SelfDraft.upcoming``) and propose that block's first round:
    vanilla's tokens, and fewer target forwards than forgetting them (the bundled target,
    sampled: its history alone predicts less there than greedy)."""
    from simsd.entrypoints.prompts import load_prompts
    from simsd.speculative.self_draft import SelfDraft
    draft = SelfDraft(DecodeConfig(block_length=4), 3, 4, width=9)
    draft.logits, draft.upcoming = "kept", "upcoming"
    draft.new_block(begun=True)  # a lookahead began the block: its own logits, nothing older
    assert (draft.logits, draft.upcoming) == ("kept", None)
    draft.upcoming = "upcoming"
    draft.new_block(begun=False)
    assert (draft.logits, draft.upcoming) == ("upcoming", None)
    target, _ = bundled_pair("float32")
    tok = target.tokenizer
    prompts = [tok(p.text, add_special_tokens=False)["input_ids"] for p in load_prompts("bundled")[:4]]
    cfg = DecodeConfig(block_length=4, max_new_tokens=48, fold_commit=True, seed=1,
                       sampling=SamplingParams(temperature=1.0))
    want = [r.token_ids for r in vanilla_generate_batch(target.model, prompts, cfg, target.mask_token_id,
                                                        target.stop_ids).results]
    forwards = []
    for forget in (False, True):
        with pytest.MonkeyPatch.context() as mp:
            if forget:  # a block no lookahead began has only the history to propose from
                mp.setattr(SelfDraft, "new_block", lambda self, begun: setattr(self, "upcoming", None) or
                           (None if begun else setattr(self, "logits", None)))
            out = speculative_generate_batch(target, "self", prompts, cfg, spec(speculation_width=24))
        assert [r.token_ids for r in out.results] == want
        forwards.append(sum(r.stats["target_forwards"] for r in out.results))
    assert forwards[0] < forwards[1], forwards


def test_a_block_begun_by_a_lookahead_proposes_from_the_copy_the_target_took(target, monkeypatch):
    """When a lookahead round's finished block is the target's, the next block's first round
    proposes from the logits of the next-block copy whose target step began it (its chain's
    deepest valid node): at every position that step revealed, those logits are the ones that
    revealed it (``Verdict.next_logits``, the same forward's). Vanilla's tokens."""
    import torch

    from simsd.speculative.self_draft import SelfExactVerifier
    checked = []
    real = SelfExactVerifier.judge

    def judge(self, rnd, out):
        v = real(self, rnd, out)
        if v.next is not None and int(v.node) in v.finished:
            tree, node = rnd.layout[0], int(v.next_node)
            state = torch.tensor(tree.ahead_states[node] if node else [self.mask_id] * v.next.shape[0])
            revealed = (v.next.cpu() != self.mask_id) & (state == self.mask_id)
            assert revealed.any()
            assert torch.equal(self.draft.logits.cpu()[revealed], v.next_logits.cpu()[revealed])
            checked.append(node)
        return v
    monkeypatch.setattr(SelfExactVerifier, "judge", judge)
    for T in (0.0, 1.0):
        cfg = cfg_for("static", T, seed=1, max_new_tokens=48, logprobs=4)
        got = speculative_generate_batch(target, "self", PROMPTS, cfg, spec(speculation_width=24))
        for i, p in enumerate(PROMPTS):
            assert got.results[i].token_ids == vanilla_ids(target, p, dataclasses.replace(cfg, seed=1 + i))
    assert checked
