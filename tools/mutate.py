#!/usr/bin/env python3
"""A small mutation runner: does the test suite notice one-line changes to the code?

Each mutant is a list of edits (file, the exact text of one line or part of it, its
replacement; the text must occur exactly once in the file) and the tests that should notice
it. Most mutants are one line; a few change the same rule in every mirror at once (the Python
mask rule, the Triton and the C++ copies), which a mirror-vs-mirror test cannot see.

For each mutant: apply the edits, run ``pytest -x`` on its tests, restore the files (always:
also on an error, a timeout or Ctrl-C), and record

* ``killed``: a test failed (or errored);
* ``killed (timeout)``: the tests ran past ``--timeout`` seconds (a hang counts as caught;
  the process group is killed);
* ``survived``: every test passed;
* ``error``: pytest could not run the tests (exit 3/4/5: internal error, usage, none collected).

Usage (from the repository root)::

    python tools/mutate.py --list              # the mutants
    python tools/mutate.py                     # run them all, print the table
    python tools/mutate.py --only 3,7-9        # some of them
    python tools/mutate.py --markdown out.md   # also write the table as Markdown

A baseline run of all the named tests without any mutant comes first (``--no-baseline`` skips
it): a mutant is only meaningful against a green suite. A mutant whose text is no longer in the
code (the code moved on) is reported as stale and not run.

The C++ edit of a multi-mirror mask mutant (``csrc/mask_rule.cuh``) takes effect only once the
CUDA extension is rebuilt (``.ci/cuda_check.sh`` builds it and runs tests/kernels/test_expected_masks.py
against it); in a CPU-only install the tests see the Python and Triton copies of the change. The
split rule in ``csrc/tile_layout.cuh`` is plain C++ as well: tests/kernels/test_cuda_layout.py
compiles it with the host compiler, so its mutants run everywhere.

Some changes are not faults and are not listed (a mutant must change what a user can observe):
dropping the round from paper mode's noise keys changes no law (a round starts at a later
block step than the last, and every proposal judged in a round is committed, so no judged noise is
reused); acceptance uniforms drawn from the ``SAMPLE`` stream are independent of paper mode's
draft (it samples from ``PAPER_DRAFT``); an API ``max_tokens + 1`` is cut by the request's text
stream at ``max_tokens`` before it shows; the invariant plan's natural tile equals
``INVARIANT_BLOCK_M`` for GQA groups >= 4; dropping the query heads from the tensor-parallel
check changes nothing (they are a multiple of the KV heads, which are checked); the engine's own
page reservation in ``BatchEngine.forward`` is a guard for direct callers: the scheduler reserved
the same pages first (``Scheduler._make_room``), so dropping it changes no scheduled run; which
proposed finished block's next-block logits a block that ends without a lookahead proposes from
(``near`` in ``SelfExactVerifier.judge``, the finish nearest the new block) is a guess of which
predictions are the likeliest: any logits are proposals, and exact verification keeps the tokens
vanilla's, so the first finish's instead changes only how many forwards a block takes.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# test groups -------------------------------------------------------------------------------------
REF = "tests/simsd/decoding/test_reference_decoder.py"
EXACT_REF = "tests/simsd/speculative/test_exact_reference.py"
STRAT = "tests/simsd/decoding/test_strategies.py"
SAMPLING = "tests/simsd/decoding/test_sampling_rules.py"
REJECT = "tests/simsd/speculative/test_rejection_sampling.py"
SPEC = "tests/simsd/speculative/test_speculative.py"
VANILLA = "tests/simsd/decoding/test_vanilla.py"
MASKS = "tests/kernels/test_expected_masks.py"
MIRROR = "tests/kernels/test_mask_mirror.py"
FLEX = "tests/kernels/test_flex_mask.py"
USER = "tests/simsd/entrypoints/test_console_script.py"
CLI = "tests/simsd/entrypoints/test_cli.py"
PROGRESS = "tests/simsd/decoding/test_progress.py"
PAPER_REF = "tests/simsd/speculative/test_paper_reference.py"
VERDICT = "tests/simsd/speculative/test_verdicts.py"
COUNTERS = "tests/simsd/speculative/test_counters.py"
EXACT_SAMPLING = "tests/simsd/speculative/test_exact_sampling.py"
NOISE = "tests/simsd/decoding/test_noise.py"
EDGES = "tests/simsd/decoding/test_sampling_edges.py"
SPLIT = "tests/kernels/test_split_plan.py"
CUDA_LAYOUT = "tests/kernels/test_cuda_layout.py"
TRITON_TILES = "tests/kernels/test_triton_tiles.py"
SELFCHECK = "tests/kernels/test_backend_selfcheck.py"
SELF = "tests/simsd/speculative/test_self_speculation.py"
WIDTH = "tests/simsd/speculative/test_width.py"
TREE = "tests/simsd/speculative/test_tree.py"
SD = "simsd/speculative/self_draft.py"
GRAPH_CHECK = "tests/simsd/engine/test_graph_check.py"
API = "tests/simsd/entrypoints/test_api.py"
OPTIONS = "tests/simsd/entrypoints/test_options.py"
PROMPTS = "tests/simsd/entrypoints/test_prompts.py"
DETOK = "tests/simsd/entrypoints/test_detokenize.py"
SCHED = "tests/simsd/engine/test_scheduler.py"
CHUNKED = "tests/simsd/engine/test_chunked_prefill.py"
SERVER = "tests/simsd/entrypoints/openai/test_server.py"
TP = "tests/simsd/engine/test_tp.py"
MEMORY = "tests/simsd/engine/test_memory.py"
SERVE_CLI = "tests/simsd/entrypoints/test_serve_cli.py"
API_ENGINE = "tests/simsd/entrypoints/test_api_engine.py"
DOOR = "tests/kernels/test_door.py"
ROWS = "tests/kernels/test_reference_rows.py"
FWD_CTX = "tests/simsd/models/test_forward_context.py"
RELEASE = "tests/simsd/speculative/test_release_variant.py"
PAPER_VARIANT = "tests/simsd/entrypoints/test_paper_variant.py"
EVAL = "tests/simsd/entrypoints/test_eval.py"
SCORING = "tests/simsd/entrypoints/test_scoring.py"
SHUTDOWN = "tests/simsd/entrypoints/test_serve_shutdown.py"
NONFINITE = "tests/simsd/entrypoints/test_nonfinite_logits.py"
LENGTH = "tests/simsd/entrypoints/test_length_bound.py"
LOADING = "tests/simsd/models/test_loading.py"
DRIVER = "tests/simsd/entrypoints/test_one_driver.py"
RAY = "tests/simsd/entrypoints/test_ray.py"
FUSED_MOE = "tests/kernels/test_fused_moe.py"
DEVICE_RUN = "tests/bench/test_device_run.py"
DEVICE_LIB = "tests/bench/test_device_lib.py"
CHECK = "tests/kernels/test_check.py"
SURFACES = "tests/simsd/entrypoints/test_surfaces.py"
DOORS = "tests/simsd/entrypoints/openai/test_doors.py"
CONNECTED = "tests/simsd/entrypoints/test_serve_connection.py"


@dataclass(frozen=True)
class Mutant:
    kind: str
    edits: tuple  # ((file, original, replacement), ...)
    tests: tuple
    note: str = ""


def m(kind, file, original, replacement, *tests, note=""):
    return Mutant(kind, ((file, original, replacement),), tuple(tests), note)


def multi(kind, edits, *tests, note=""):
    return Mutant(kind, tuple(edits), tuple(tests), note)


MR, TR, CR = "simsd_kernels/mask_rule.py", "triton_ops/common.py", "csrc/mask_rule.cuh"
SR, VER = "simsd/speculative/spec_row.py", "simsd/speculative/verification.py"
VFY, PROG = "simsd/speculative/verifiers.py", "simsd/decoding/program.py"
STEP, BAT = "simsd/decoding/step.py", "simsd/engine/batching.py"
LAY = "simsd/decoding/layouts.py"
LOGPROBS_MODES = "tests/simsd/speculative/test_logprobs_modes.py"
PENALTIES = "tests/simsd/decoding/test_penalties.py"
PAGED_DOOR = "tests/kernels/test_paged_door.py"
PAGED_CACHE = "tests/simsd/models/test_paged_cache.py"
PAGED_ENGINE = "tests/simsd/engine/test_paged_engine.py"
KV_PAGES = "tests/simsd/entrypoints/test_kv_pages.py"
EXACT_PENALTIES = "tests/simsd/speculative/test_exact_penalties.py"
NGRAM_TESTS = "tests/simsd/speculative/test_ngram.py"
HOST_READS = "tests/simsd/engine/test_host_reads.py"
PROTO, REQ = "simsd/entrypoints/openai/protocol.py", "simsd/config/request.py"
SERVING, MIDDLEWARE = "simsd/entrypoints/openai/serving.py", "simsd/entrypoints/openai/middleware.py"
OSTATE, OERRORS = "simsd/entrypoints/openai/state.py", "simsd/entrypoints/openai/errors.py"
CONNECTION = "simsd/entrypoints/openai/connection.py"
#: the request fields a server request gives (protocol.py), and the same with one of them dropped
GIVEN = "given = {name: getattr(self, name) for name in settings_of(SamplingParams) if getattr(self, name) is not None}"
ignoring = lambda field: GIVEN[:-1] + f' and name != "{field}"' + "}"  # noqa: E731
SAMP, STRATS, FIELDS = "simsd/decoding/sampling.py", "simsd/decoding/strategies.py", "simsd/config/fields.py"
VOCAB, SPECS = "simsd/config/vocabulary.py", "simsd/config/speculative.py"
NZ, SP, GR = "simsd/decoding/noise.py", "simsd_kernels/split_plan.py", "simsd/engine/graphs.py"

MUTANTS = [
    # 1. exact == vanilla with several tokens per step: verdicts and the schedule -------------------
    m("verdict", VER, "taken = depth.index_select(0, valid.view(1))[0] + copies.index_select(0, valid.view(1))[0]",
      "taken = depth.index_select(0, valid.view(1))[0]", EXACT_REF,
      note="issue 13 item 1: the steps taken miss the valid node's own target step"),
    m("schedule", "simsd/decoding/config.py", "return self.schedule[min(step, len(self.schedule) - 1)]",
      "return self.schedule[min(step + 1, len(self.schedule) - 1)]", REF, EXACT_REF,
      note="issue 13 item 1: schedule lookup shifted by one"),
    m("schedule", STEP, "ks = [cfg.tokens_for_step(int(s)) for s in step]",
      "ks = [cfg.tokens_for_step(int(s) + 1) for s in step]", EXACT_REF,
      note="the lookup of a batch of steps shifted by one (the exact copies' steps)"),
    m("schedule", STRATS, "return [base + (1 if i < rem else 0) for i in range(steps)]",
      "return [base + (1 if i >= steps - rem else 0) for i in range(steps)]", REF, STRAT,
      note="remainder added to the last steps"),
    m("verdict", VFY, "[rnd.step + tree.depth[j] for j in tree.copy_nodes()]",
      "[rnd.step + 1 + tree.depth[j] for j in tree.copy_nodes()]", EXACT_REF,
      note="the target's own decision at copy c taken at the wrong step of the schedule"),
    m("verdict", VER, "(stepped.index_select(0, parent) == states[1:]).all(-1)",
      "(stepped.index_select(0, parent) == states[1:]).any(-1)", EXACT_REF,
      note="a draft step accepted when any position agrees"),
    m("verdict", VER, "new = stepped.index_select(0, valid.view(1))[0]", "new = valid_state", EXACT_REF,
      note="the valid node's own target step never committed (its state instead)"),
    m("verdict", VER, "return best == drafted, best", "return best == drafted, drafted", SPEC, EXACT_REF,
      note="greedy: the rejected draft token kept instead of the target's argmax"),
    m("verdict", VER, "order = torch.sort(tau, stable=True).indices",
      "order = torch.sort(tau.masked_fill(prop, 0), stable=True).indices", SPEC, REJECT,
      note="proposals accepted in position order, not in the draft's temporal order"),
    # 2. strategies (held to the independent reference) ---------------------------------------------
    m("strategy", STRATS, "return masked & (masked.cumsum(-1) <= k)",
      "return masked & (masked.flip(-1).cumsum(-1).flip(-1) <= k)", REF,
      note="sequential from the right"),
    m("strategy", STRATS, "top = masked & (stable_rank(confidence.masked_fill(~masked, float(\"-inf\")), True) < k)",
      "top = masked & (stable_rank(confidence, True) < k)", REF,
      note="top-k ranks known positions too (fewer reveals)"),
    m("strategy", STRATS, "return torch.where(above.sum(-1, keepdim=True) >= k, above, top)",
      "return torch.where(above.sum(-1, keepdim=True) >= 1, above, top)", REF, STRAT,
      note="dynamic: the positions above the threshold even when fewer than k"),
    m("strategy", STRATS, "n = ((ranked.cumsum(-1) <= threshold).sum(-1, keepdim=True)).clamp_min(1)",
      "n = ((ranked <= threshold).sum(-1, keepdim=True)).clamp_min(1)", REF, STRAT,
      note="entropy bound on each entropy, not on their sum"),
    m("strategy", STRATS, "above = masked & (confidence > threshold)", "above = masked & (confidence >= threshold)",
      STRAT, note="dynamic's strict '>'"),
    # 4. confidence, temperature, top-k, top-p ------------------------------------------------------
    m("confidence", SAMP, "confidence = base.gather(-1, tokens[..., None]).squeeze(-1)",
      "confidence = (base if params.greedy else probs).gather(-1, tokens[..., None]).squeeze(-1)", SAMPLING,
      note="issue 13 item 4: confidence from the filtered distribution when sampling"),
    m("confidence", SAMP, "t = 1.0 if params.greedy else params.temperature", "t = 1.0", SAMPLING,
      note="issue 13 item 4: confidence ignores the temperature"),
    m("confidence", SAMP, "t = 1.0 if params.greedy else params.temperature",
      "t = 2.0 if params.greedy else params.temperature", REF, SAMPLING,
      note="greedy confidence at temperature 2 instead of 1"),
    m("sampling", SAMP, "scores = scores.masked_fill(scores < kth, float(\"-inf\"))",
      "scores = scores.masked_fill(scores <= kth, float(\"-inf\"))", SAMPLING, note="top-k keeps k - 1"),
    m("sampling", SAMP, "drop = cum - torch.softmax(sorted_scores, dim=-1) >= params.top_p",
      "drop = cum >= params.top_p", SAMPLING, note="top-p drops the token that crosses p"),
    m("sampling", SAMP, "scores = scaled_scores(logits, params.temperature)", "scores = scaled_scores(logits, 1.0)",
      SAMPLING, note="sampling ignores the temperature"),
    m("sampling", SAMP, "return (weights.float() / noise.clamp_min(torch.finfo(torch.float32).tiny)).argmax(-1)",
      "return (weights.float() * noise.clamp_min(torch.finfo(torch.float32).tiny)).argmax(-1)", SAMPLING,
      note="a biased draw"),
    m("sampling", SAMP, "entropy = -(base * torch.log(base.clamp_min(1e-30))).sum(-1) if with_entropy else None",
      "entropy = -(base * torch.log(base.clamp_min(1e-30))).sum(-1) / 2 if with_entropy else None", SAMPLING, REF,
      note="entropy off by a factor"),
    # 3. rejection sampling and reveal-step bookkeeping -----------------------------------------------
    m("reveal step", VER, "taus = F.pad(tau.to(device), (0, 1)).index_select(0, tau_index).to(torch.int32)",
      "taus = F.pad(tau.to(device), (0, 1)).index_select(0, tau_index).to(torch.int32); taus[nl + n:] = 1",
      PAPER_REF, REJECT, note="issue 13 item 3: every proposal judged as at the round's first step (M slots "
                              "labelled tau = 1: they see no draft token)"),
    m("reveal step", SR, "probs = torch.where(revealed[:, None], p.to(probs.dtype), probs)",
      "probs = p.to(probs.dtype)", REJECT, note="the draft distribution of the last step, not the reveal step"),
    m("reveal step", SR, "tau.masked_fill_(revealed, c + 1)", "tau.masked_fill_(revealed, c + 2)",
      REJECT, EXACT_REF, note="reveal steps off by one"),
    m("rejection", VER, "ok = (pd_x > 0) & (u.double() * pd_x.double() < pt_x.double())",
      "ok = (pd_x > 0) & (u.double() * pt_x.double() < pd_x.double())", REJECT, note="accept with min(1, p_d / p_t)"),
    m("rejection", VER, "residual = (p_t - p_d).clamp_min(0)", "residual = p_t.clone()", REJECT,
      note="a rejected token resampled from p_t instead of the residual"),
    m("verdict", VFY, "tree.states.index_select(0, shape[0]), [rnd.step",
      "tree.states.index_select(0, torch.cat([shape[0][:-1], shape[0][-2:-1]])), [rnd.step", EXACT_REF, REJECT,
      note="the bonus step taken on the last draft copy's logits (that copy's tokens in the bonus slot)"),
    # 5. stop ids ---------------------------------------------------------------------------------------
    m("stop ids", SR, "dec.t.stop_ids if stop_ids is None else stop_ids, seed)",
      "dec.d.stop_ids if stop_ids is None else stop_ids, seed)", EXACT_REF,
      note="issue 13 item 5: stop ids (and the output's cut) of the draft checkpoint"),
    m("stop ids", "simsd/decoding/config.py", "        if t in stops:", "        if t in stops and len(out) > 1:",
      REF, EXACT_REF, note="a stop id as the first generated token is missed"),
    m("stop ids", PROG, "new = blk.host[blk.first:]", "new = blk.host[blk.first:-1]", REF,
      note="a stop id as the last token of a block does not end decoding"),
    m("stop ids", PROG, "new = blk.host[blk.first:]", "new = blk.host[blk.first + 1:]", EXACT_REF,
      note="a stop id as the first token of a block does not end decoding"),
    # 7. the mask rule, in every mirror -------------------------------------------------------------------
    multi("mask rule (all mirrors)", [
        (MR, "from_draft = q_draft & (k_known | (k_draft & (tau_k <= tau_q)) | (k_mask & (tau_k > tau_q)))",
         "from_draft = q_draft & (k_known | (k_draft & (tau_k < tau_q)) | (k_mask & (tau_k > tau_q)))"),
        (TR, "from_draft = q_draft & (k_known | (k_draft & (tau_k <= tau_q)) | (k_mask & (tau_k > tau_q)))",
         "from_draft = q_draft & (k_known | (k_draft & (tau_k < tau_q)) | (k_mask & (tau_k > tau_q)))"),
        (CR, "if (kq == kDraft) return (kk == kDraft && tk <= tq)",
         "if (kq == kDraft) return (kk == kDraft && tk < tq)"),
    ], MASKS, MIRROR, FLEX, note="D_i does not see D_j with tau_j = tau_i (itself, ties)"),
    multi("mask rule (all mirrors)", [
        (MR, "from_mask = q_mask & (k_known | (k_draft & (tau_k < tau_q)) | (k_mask & (tau_k >= tau_q)))",
         "from_mask = q_mask & (k_known | (k_draft & (tau_k < tau_q)) | (k_mask & (tau_k > tau_q)))"),
        (TR, "from_mask = q_mask & (k_known | (k_draft & (tau_k < tau_q)) | (k_mask & (tau_k >= tau_q)))",
         "from_mask = q_mask & (k_known | (k_draft & (tau_k < tau_q)) | (k_mask & (tau_k > tau_q)))"),
        (CR, "(kk == kMask && tk >= tq)", "(kk == kMask && tk > tq)"),
    ], MASKS, MIRROR, FLEX, note="M_i does not see M_j with tau_j = tau_i"),
    multi("mask rule (all mirrors)", [
        (MR, "from_known = (kind_q == KIND_KNOWN) & k_known", "from_known = (kind_q == KIND_KNOWN)"),
        (TR, "from_known = (kind_q == KIND_KNOWN) & k_known", "from_known = (kind_q == KIND_KNOWN)"),
        (CR, "if (kq == kDraft) return", "if (kq == kKnown) return true;\n      if (kq == kDraft) return"),
    ], MASKS, MIRROR, FLEX, note="leftover sees D and M"),
    multi("mask rule (all mirrors)", [
        (MR, "return (grp_k == grp_q) | (grp_k == SHARED_GRP)", "return (grp_k == grp_q) | (grp_q == SHARED_GRP)"),
        (TR, "res = (grp_k == grp_q) | (grp_k == -1)", "res = (grp_k == grp_q) | (grp_q == -1)"),
        (CR, "return gk == gq || gk == kSharedGrp ||", "return gk == gq || gq == kSharedGrp ||"),
    ], MASKS, MIRROR, FLEX, note="exact: the shared prefix sees every copy, copies do not see it"),
    m("mask rule (one mirror)", TR, "res = (grp_k == grp_q) | (grp_k == -1)", "res = grp_k == grp_q", MASKS,
      note="Triton only: the shared prefix invisible"),
    m("mask rule (one mirror)", "simsd_kernels/flex.py", "return torch.where(in_cache, kv_idx < cache_seqlens[b], new)",
      "return torch.where(in_cache, kv_idx <= cache_seqlens[b], new)", MASKS, note="Flex: one cache slot too many"),
    m("mask rule (one mirror)", "simsd_kernels/reference.py",
      "cache_vis = torch.arange(cache_len, device=labels.device)[None, :] < cache_seqlens[:, None].to(torch.int64)",
      "cache_vis = torch.arange(cache_len, device=labels.device)[None, :] <= cache_seqlens[:, None].to(torch.int64)",
      MASKS, note="dense torch mask: one cache slot too many"),
    m("mask padding", "simsd/engine/batching.py", '"paper": (KIND_MASK, 0, 0)', '"paper": (KIND_MASK, 1, 0)', MASKS,
      note="paper padding visible to M slots with tau = 1"),
    m("mask padding", "simsd/engine/batching.py", '"exact": (0, 0, 1 << 30)', '"exact": (0, 0, 0)', MASKS,
      note="exact padding joins copy 0"),
    # cache commits and the layouts ---------------------------------------------------------------------
    m("cache commit", LAY, "[KNOWN] * L + [(KIND_KNOWN, 0, 1)] * L, \"block_causal\"",
      "[KNOWN] * (L + 1) + [(KIND_KNOWN, 0, 1)] * (L - 1), \"block_causal\"", REF, EXACT_REF,
      note="folded commit: the next block's first token joins the committed block"),
    m("cache commit", LAY, "[(KIND_KNOWN, 0, SHARED_GRP)] * P + labels", "[(KIND_KNOWN, 0, 0)] * P + labels",
      EXACT_REF,
      note="folded commit in exact mode seen by copy 0 only"),
    m("cache commit", SR, "if self.carried is None or self.carried.committed is None:",
      "if self.carried is not None and self.carried.committed is None:", SPEC,
      note="the draft never commits its blocks (its cache goes stale)"),
    m("layout", VER, "m_pos = [start + i for i in unk] if rope_copy else [start + L + j for j in range(n)]",
      "m_pos = [start + i + 1 for i in unk] if rope_copy else [start + L + j for j in range(n)]", SPEC,
      note="RoPE copy off by one position"),
    m("layout", VER, "taus = F.pad(tau.to(device), (0, 1)).index_select(0, tau_index).to(torch.int32)",
      "taus = F.pad(tau.to(device), (0, 1)).index_select(0, tau_index).to(torch.int32); taus[nl + n:] += 1", SPEC,
      note="M slots labelled one step late (a draft token sees its own verification)"),
    # further instances of the kinds above (tried after the tests were written) ----------------------
    m("verdict", VER, "taken = tau.masked_fill(before, TAU_INF).min().clamp(max=n)",
      "taken = torch.where(rejected, tau.masked_fill(before, TAU_INF).min() - 1, n)", PAPER_REF,
      note="paper: the steps a rejected round used, one short"),
    m("verdict", VER, "taken = tau.masked_fill(before, TAU_INF).min().clamp(max=n)",
      "taken = torch.where(rejected, tau.masked_fill(before, TAU_INF).min(), n - 1)", PAPER_REF,
      note="paper: the steps an accepted round used, one short"),
    m("verdict", VER, "stepped = states.index_copy(0, copy_index, mine)",
      "stepped = states.index_copy(0, copy_index[:-1], mine[:-1])", EXACT_REF,
      note="exact: the bonus copy's step replaced by the draft's final state"),
    m("verdict", VFY, "at = without_mask_token_(logits.index_select(0, rnd.layout), self.mask_id)",
      "at = without_mask_token_(logits.index_select(0, (rnd.layout - rnd.host.count(self.mask_id)).clamp_min(0)), "
      "self.mask_id)", PAPER_REF, SPEC, note="paper: proposals judged at their D slot instead of their M slot"),
    m("schedule", VFY, "return cfg, block_step + c", "return cfg, c", PAPER_REF, EXACT_SAMPLING,
      note="the draft's step (schedule and noise key) restarts at every round"),
    m("schedule", SR, "if self.plan.spec.on_reject == \"fallback\" and blk.host.count(self.mask_id) < self.plan.gamma:",
      "if self.plan.spec.on_reject == \"fallback\" and blk.host.count(self.mask_id) <= self.plan.gamma:", PAPER_REF,
      note="the paper's fallback one position early"),
    m("strategy", FIELDS, 'DEFAULT_THRESHOLD = {"dynamic": 0.9, "entropy": 0.35}',
      'DEFAULT_THRESHOLD = {"dynamic": 0.8, "entropy": 0.35}', REF, note="another default threshold"),
    m("sampling", SAMP, "kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]",
      "kth = torch.topk(scores, params.top_k, dim=-1).values[..., :1]", SAMPLING, note="top-k keeps the top 1"),
    m("rejection", VER, "p_t = filtered_probs(logits, params)", "p_t = torch.softmax(logits.float(), -1)", REJECT,
      note="rejection sampling against the unfiltered target at temperature 1"),
    m("layout", VER, "positions = [start + i for i in left] + [start + i for i in unk] + m_pos",
      "positions = [start + i for i in left] + [start + L + j for j in range(n)] + m_pos", PAPER_REF, SPEC,
      note="paper: D slots at fresh positions"),
    m("layout", "simsd/decoding/layouts.py", "positions = list(range(start, start + L)) * n",
      "positions = list(range(start + 1, start + L + 1)) * n", EXACT_REF,
      note="exact: copies one position late"),
    m("cache commit", VFY, "fwd = layouts.exact(\"target\", *exact_layout(copies, rnd.start))",
      "fwd = layouts.exact(\"target\", *exact_layout(copies, layouts.row.cached[\"target\"]))", EXACT_REF,
      note="exact with a folded commit: copies placed before the pending block"),
    # 8-9. what the user runs; hangs ------------------------------------------------------------------------
    m("user path", "simsd/assets/__init__.py", 'DEFAULT_DRAFT = ASSETS / "tiny-sdar-draft"',
      'DEFAULT_DRAFT = ASSETS / "tiny-sdar-draft-missing"', USER, note="issue 13 item 8: bundled draft missing"),
    m("user path", "simsd/assets/__init__.py", 'DEFAULT_TARGET = ASSETS / "tiny-sdar-target"',
      'DEFAULT_TARGET = ASSETS / "tiny-sdar-draft"', USER, note="the bundled target is the draft"),
    m("user path", "simsd/entrypoints/commands.py", "dataclasses.replace(base, seed=(seed + i) % (SEED_MAX + 1))",
      "dataclasses.replace(base, seed=(seed + i) % (SEED_MAX + 1), max_tokens=base.max_tokens + 1)", CLI, USER,
      note="--max-tokens off by one"),
    m("user path", "simsd/entrypoints/detokenize.py", 'self.finish_reason, self.stop_reason = "stop", t',
      'self.finish_reason, self.stop_reason = "stop", t; self._text += self.detok.push([t])', CLI, USER,
      note="the text keeps the stop token"),
    m("user path", "simsd/decoding/config.py",
      "sampling=StepSampling(params.temperature, params.top_k, params.top_p, params.presence_penalty,",
      "sampling=StepSampling(params.temperature, params.top_k, 1.0, params.presence_penalty,", API,
      note="the API ignores a request's top_p"),
    m("user path", "simsd/entrypoints/encoding.py", "any(t + r in rendered for r in roles)",
      "any(t in rendered for r in roles)", OPTIONS,
      note="every special token of the chat template ends the answer, not only the role markers"),
    m("user path", "simsd/entrypoints/prompts.py", 'line = line.lstrip("\\ufeff")', "line = line", PROMPTS,
      note="a prompt file with a byte-order mark is refused"),
    m("user path", FIELDS, "return self.temperature < MIN_TEMPERATURE or self.top_k == 1",
      "return self.temperature < MIN_TEMPERATURE", OPTIONS,
      note="--seed accepted with --top-k 1 (greedy: the seed would be ignored)"),
    m("user path", FIELDS, "return self.temperature < MIN_TEMPERATURE or self.top_k == 1",
      "return self.temperature == 0 or self.top_k == 1", OPTIONS,
      note="--seed accepted with a temperature too small to sample at (greedy: the seed would be ignored)"),
    m("user path", "simsd/entrypoints/builder.py", "if default_params.max_tokens >= max_model_len:",
      "if default_params.max_tokens > 10 ** 9:", "tests/simsd/entrypoints/test_serve_cli.py",
      note="serve starts with a default max_tokens that leaves no room for a prompt"),
    m("user path", VOCAB, "if value is not None and not 1 <= value <= high:",
      "if value is not None and not 1 <= value < high:", OPTIONS,
      note="--steps equal to the block length refused"),
    m("hang", STEP, "logits = without_mask_token_(logits, mask_id)", "logits = logits",
      PROGRESS, VANILLA, note="issue 13 item 9: MASK can be 'revealed' (no progress)"),
    m("hang", VER, "new = stepped.index_select(0, valid.view(1))[0]", "new = states[0]", PROGRESS,
      note="an exact round that commits nothing"),
    m("hang", STRATS, "n = ((ranked.cumsum(-1) <= threshold).sum(-1, keepdim=True)).clamp_min(1)",
      "n = ((ranked.cumsum(-1) <= threshold).sum(-1, keepdim=True)).clamp_min(0)", STRAT, REF, PROGRESS,
      note="entropy: a step under a tight bound reveals nothing (no progress)"),
    m("hang", "simsd/engine/scheduler.py", "if req.forward_requests <= limit:",
      "if req.forward_requests <= limit * 10 ** 9:", PROGRESS,
      note="the scheduler's bound on a row's requests removed: a program that never finishes loops"),
    # counters (issue 13 item 6; docs/statistics.md) ---------------------------------------------------
    m("counters", SR, "proposals = self.verifier.acceptance_order(tau, draft.n)",
      "proposals = self.verifier.acceptance_order(tau, taken)", COUNTERS,
      note="proposed counts only the steps a round took (the draft steps after a rejection dropped)"),
    m("counters", VER, "    return new, rejected, taken, r\n", "    return new, rejected, taken, r + rejected.long()\n",
      COUNTERS,
      note="paper: accepted off by one (the corrected proposal counted)"),
    m("counters", VER, "return new, taken, (valid_state != states[0]).sum()",
      "return new, taken, (new != states[0]).sum()", VERDICT, COUNTERS,
      note="exact: the rejected step's tokens counted as accepted"),
    m("counters", SR, "self.stats.target_tokens += i not in from_draft", "self.stats.target_tokens += i in from_draft",
      COUNTERS, note="target_tokens counts the draft's tokens (target_tokens / from_draft swapped)"),
    m("counters", SR, "from_draft = sum(1 for o in self.stats.origins[:n] if o)",
      "from_draft = sum(1 for o in self.stats.origins[:n] if not o)", COUNTERS,
      note="from_draft counts the target's tokens"),
    m("counters", SR, "from_draft = sum(1 for o in self.stats.origins[:n] if o)",
      "from_draft = sum(1 for o in self.stats.origins if o)", COUNTERS,
      note="from_draft counts the cut tokens too"),
    m("counters", SR, '"draft_share": from_draft / n if n else 0.0,',
      '"draft_share": from_draft / len(self.stats.origins) if n else 0.0,', COUNTERS,
      note="draft_share over the decoded tokens, not the returned ones"),
    m("counters", SR, "accepted = set(proposals[:acc])", "accepted = set(proposals[:acc + 1])", COUNTERS,
      note="the target's correction counted as the draft's"),
    m("counters", SR, "self.stats.origins.extend(self.origin[blk.first:])", "self.stats.origins.extend(self.origin)",
      COUNTERS, note="origins include the prompt tail's positions (from_draft shifted)"),
    m("counters", PROG, "\"cut_tokens\": len(self.generated) - n,", "\"cut_tokens\": self.cfg.max_new_tokens - n,",
      COUNTERS, note="cut_tokens counted against the budget, not the decoded tokens"),
    m("counters", PROG, "\"cut_tokens\": len(self.generated) - n,",
      "\"cut_tokens\": max(0, len(self.generated) - self.cfg.max_new_tokens),",
      COUNTERS, note="tokens cut after a stop id not counted"),
    # keyed noise (docs/design.md §4.2) --------------------------------------------------------------
    m("noise", NZ, "state = mix64_(base[:, None] + pos * _signed(GOLDEN))", "state = mix64_(base[:, None] + 0 * pos)",
      NOISE, note="key field dropped: position"),
    m("noise", NZ, "state = mix64_(state + steps.reshape(R, 1) * _signed(GOLDEN))",
      "state = mix64_(state + 0 * steps.reshape(R, 1))", NOISE, note="key field dropped: step"),
    m("noise", NZ, "z = mix64(self.seed)", "z = mix64(0)", NOISE, note="key field dropped: seed"),
    m("noise", STEP, "noise = step_noise(keys, index, L, batch.shape[2], batch.device)",
      "noise = step_noise(keys, 0, L, batch.shape[2], batch.device)", NOISE, EXACT_SAMPLING,
      note="every denoising step draws the noise of the block's step 0, in the engine and in exact verification "
           "alike (exact still equals vanilla)"),
    m("noise", VFY, "u = uniform([self.key(rnd.start, ACCEPT, rnd.index)], 0, L, 1, at.device)[0, :, 0]",
      "u = uniform([self.key(rnd.start, 1, rnd.index)], 0, L, 1, at.device)[0, :, 0]", REJECT,
      note="paper: the acceptance uniforms reuse the draft's sampling stream (PAPER_DRAFT = 1)"),
    m("noise", VFY, "rng = (u, step_noise([self.key(rnd.start, RESIDUAL, rnd.index)], 0, L, V, at.device)[0])",
      "rng = (u, step_noise([self.key(rnd.start, 1, rnd.index)], 0, L, V, at.device)[0])", REJECT,
      note="paper: the residual draw reuses the draft's sampling stream (PAPER_DRAFT = 1)"),
    # exact verdicts on hand-made cases ---------------------------------------------------------------
    m("verdict", VER, "(stepped.index_select(0, parent) == states[1:]).all(-1)",
      "(stepped.index_select(0, parent).sort(-1).values == states[1:].sort(-1).values).all(-1)", VERDICT,
      EXACT_REF, note="exact: a draft step accepted on its tokens only (not their positions)"),
    m("verdict", STEP, "noise = step_noise(keys, index, L, batch.shape[2], batch.device)",
      "noise = step_noise(keys, [steps[j].index for j in rows for _ in range(sizes[j])], L, batch.shape[2], "
      "batch.device)", EXACT_SAMPLING,
      note="exact under sampling: every copy's step drawn with the round's first step's noise"),
    # the split plan (shape-invariant mode) -------------------------------------------------------------
    m("split plan", SP, "batch, q_len = 1, INVARIANT_Q_LEN", "batch = 1", SPLIT,
      note="the invariant plan sized for the call's Lq"),
    m("split plan", SP, "work = cdiv(max(cache_len, 0), BLOCK_N) + (0 if invariant else cdiv(q_len, BLOCK_N))",
      "work = cdiv(max(cache_len, 0), BLOCK_N) + cdiv(q_len, BLOCK_N)", SPLIT, CUDA_LAYOUT,
      note="Python: the invariant active split count depends on Lq"),
    m("split plan", "triton_ops/attention.py", "active = tl.maximum(1, tl.minimum(num_splits, work // min_tiles))",
      "active = tl.maximum(1, tl.minimum(num_splits, (ct + nt) // min_tiles))", TRITON_TILES,
      note="Triton: the invariant active split count depends on Lq"),
    m("split plan", "csrc/tile_layout.cuh", "+ (invariant ? 0 : cdiv(q_len, kBlockN));", "+ cdiv(q_len, kBlockN);",
      CUDA_LAYOUT, note="C++ (compiled on the CPU by the layout test): the invariant active split count depends on Lq"),
    multi("split plan (all mirrors)", [
        (SP, "work = cdiv(max(cache_len, 0), BLOCK_N) + (0 if invariant else cdiv(q_len, BLOCK_N))",
         "work = cdiv(max(cache_len, 0), BLOCK_N) + cdiv(q_len, BLOCK_N)"),
        ("triton_ops/attention.py", "active = tl.maximum(1, tl.minimum(num_splits, work // min_tiles))",
         "active = tl.maximum(1, tl.minimum(num_splits, (ct + nt) // min_tiles))"),
        ("csrc/tile_layout.cuh", "+ (invariant ? 0 : cdiv(q_len, kBlockN));", "+ cdiv(q_len, kBlockN);"),
    ], CUDA_LAYOUT, SPLIT, TRITON_TILES, note="the invariant active split count depends on Lq in every mirror"),
    # self-checks: backends and CUDA graphs (docs/design.md §5) --------------------------------------
    m("backend self-check", "simsd_kernels/selfcheck.py", "tol = 2 * baseline.max_err + ERR_FLOOR[q.dtype]",
      'tol = float("inf")', SELFCHECK, note="the tolerance ignored (only NaN fails)"),
    m("backend self-check", "simsd_kernels/selfcheck.py", "mean_tol = 2 * baseline.mean_err + MEAN_ERR_FLOOR[q.dtype]",
      'mean_tol = float("inf")', SELFCHECK, note="the mean-error bound ignored (a 1% softmax scale passes in bf16)"),
    m("backend self-check", "triton_ops/common.py", "    if INTERPRETER:\n        if DTYPE == tl.bfloat16:",
      "    if False:\n        if DTYPE == tl.bfloat16:", SELFCHECK,
      note="the interpreter's truncating bf16 cast left as is (its bias reads as a scale error)"),
    m("backend self-check", "simsd_kernels/backends.py", "hit = _VERDICTS[key] = (result.ok, result.detail)",
      "hit = _VERDICTS[key] = (True, result.detail)", SELFCHECK, note="a failing verdict treated as a pass"),
    m("backend self-check", "simsd_kernels/selfcheck.py",
      'poisoned[4] = to(v_cache.masked_fill(unread[..., None, None], float("nan")))', "poisoned[4] = clean[4]",
      SELFCHECK, note="unread V cache slots not poisoned (a backend reading past cache_seqlens passes)"),
    m("graph self-check", GR, "if not diff <= t:  # NaN fails too", "if diff > t:", GRAPH_CHECK,
      note="a NaN replay passes the check"),
    m("graph self-check", GR, "got.append(self._written(lengths, g.ids.shape[1]))", "pass", GRAPH_CHECK,
      note="the K/V a replay wrote not compared"),
    m("graph self-check", GR, "self.cache.seqlens.copy_(lengths)", "pass", GRAPH_CHECK,
      note="the eager rerun starts from the lengths the replay advanced"),
    m("graph self-check", GR, "t = GRAPH_TOL.get(self.model.dtype, 1e-2) * max(1.0, ref)",
      "t = GRAPH_TOL.get(self.model.dtype, 1e-2) * max(1.0, ref) * 1e9", GRAPH_CHECK,
      note="the tolerance ignored"),
    # sampling edges (issue 15) -----------------------------------------------------------------------------
    m("sampling", SAMP, "drop[..., 0] = False", "drop[..., 0] = drop[..., 0]", EDGES, SAMPLING,
      note="a tiny top_p drops every token"),
    m("sampling", SAMP, "return (x - x.amax(-1, keepdim=True)) / temperature", "return x / temperature", EDGES,
      note="small temperatures divide the raw logits (overflow)"),
    # issue 23: the uniform's grid, and promises at their edges ------------------------------------------
    m("noise", NZ, "_BITS = 23", "_BITS = 24", NOISE,
      note="issue 23: the uniform from 24 bits in float32 (upper half rounded to even, the top word is 1.0)"),
    m("noise", NZ, "return _shr(w, 64 - _BITS).to(torch.float32).add_(0.5).mul_(2.0 ** -_BITS)",
      "return _shr(w, 64 - _BITS).to(torch.float32).add_(1.0).mul_(2.0 ** -_BITS)", NOISE,
      note="the uniform (k + 1) / 2**23: the all-ones word gives 1.0 (an Exp(1) draw of 0 wins any race)"),
    m("user path", "simsd/entrypoints/detokenize.py", "window = max(0, start - max(len(s) for s in self.stop) + 1)",
      "window = max(0, start - max(len(s) for s in self.stop) + 2)", DETOK,
      note="issue 23: a stop string completed by the first character of a token is not found"),
    m("batch retry", "simsd/engine/scheduler.py", "self.engine.caches[name].seqlens[i] = cached", "pass", SCHED,
      note="issue 23: after a failed commit forward the innocent rows' cache lengths are not rolled back"),
    m("api counters", SERVING, 'extra = {"usage": usage(outs, call.n)} if not left else {}',
      'extra = {"usage": usage([payload])} if not left else {}', SERVER,
      note="issue 23: a stream of several prompts reports the usage of its last choice only"),
    m("protocol", PROTO,
      "return super().sampling_params(defaults, self.max_completion_tokens)",
      "return super().sampling_params(defaults)", SERVER, note="issue 23: chat max_completion_tokens ignored"),
    m("prompt bounds", "simsd/decoding/config.py", "if max_model_len is not None and max_model_len <= limit:",
      "if False:", API, note="issue 23: max_model_len not a bound of a request (only the model's positions)"),
    m("backend self-check", "simsd_kernels/selfcheck.py",
      "return (a.to(torch.float64) - b.to(torch.float64)).abs().max().item() if a.numel() else 0.0",
      "return (a.to(torch.float64) - b.to(torch.float64)).max().item() if a.numel() else 0.0", SELFCHECK,
      note="issue 23: the error signed (a backend = reference - 0.5 passes)"),
    m("tp check", "simsd/engine/tp.py", '("intermediate_size", c.intermediate_size)]', "]", TP,
      note="issue 23: --tp 2 on an odd intermediate_size not refused (a channel dropped)"),
    # the same kinds elsewhere (issue 23: boundary values, commit paths, multi-prompt figures, signs) ------
    m("api counters", SERVING, 'c = sum(len(o.token_ids) for o in outs)',
      'c = sum(len(o.token_ids) for o in outs[-1:])', SERVER,
      note="usage of several prompts: the completion tokens of the last choice only"),
    m("api counters", SERVING, '"choices": choices, "usage": usage(outs, n)}',
      '"choices": choices, "usage": usage(outs[:1])}', SERVER,
      note="a completion of several prompts (not streamed) reports the usage of its first choice"),
    m("api counters", "simsd/entrypoints/driver.py", 't["prompt_tokens"] += len(handle.prompt_token_ids)',
      't["prompt_tokens"] += len(handle.stream.token_ids)', API, SERVER,
      note="metrics: prompt tokens counted as the generated ones"),
    m("api counters", "simsd/entrypoints/driver.py", 't["proposed"] += counters.proposed',
      't["proposed"] += counters.accepted', API, SERVER, note="metrics: proposed counts the accepted tokens"),
    m("api counters", "simsd/entrypoints/driver.py", 't["draft_forwards"] += prog.row.forwards.get("draft", 0)',
      't["draft_forwards"] += prog.row.forwards.get("target", 0)', API, SERVER,
      note="metrics: draft forwards counted as the target's"),
    m("api counters", "simsd/entrypoints/openai/metrics.py",
      'value=m["target_forwards"] / m["generation_tokens"] if m["generation_tokens"] else nan)',
      'value=m["target_forwards"] / (m["generation_tokens"] + m["prompt_tokens"]) if m["generation_tokens"] else nan)',
      SERVER, note="/metrics: target forwards per token over prompt and generated tokens"),
    m("api counters", "simsd/entrypoints/openai/metrics.py", "self.tpot.observe((seconds - ttft) / (n - 1))",
      "self.tpot.observe((seconds - ttft) / n)", SERVER, note="/metrics: time per output token over n, not n - 1"),
    m("batch retry", "simsd/engine/scheduler.py",
      "row.cached[name], row.forwards[name], row.query_tokens[name] = cached, forwards, tokens",
      "row.cached[name], row.query_tokens[name] = cached, tokens", SCHED,
      note="after a failed batched forward the innocent rows' forward counters keep the failed forward"),
    m("admission", "simsd/engine/scheduler.py", "if req.capacity > self.engine.capacity:",
      "if req.capacity >= self.engine.capacity:", SCHED, API,
      note="a request that needs exactly a row's capacity refused"),
    m("admission", "simsd/engine/scheduler.py",
      "return len(self._waiting) + len(self._admitting) < self.max_waiting + len(self._free)",
      "return len(self._waiting) + len(self._admitting) <= self.max_waiting + len(self._free)",
      SCHED, API, note="one request more than max_waiting queued"),
    m("admission", "simsd/engine/scheduler.py", "            return self._room()\n", "            return True\n",
      SCHED, API, note="has_room says yes when the queue is full (a blocking submit refused)"),
    m("protocol", PROTO, GIVEN, ignoring("top_k"), SERVER, API_ENGINE,
      note="a request's top_k ignored"),
    m("protocol", PROTO, GIVEN, ignoring("stop_token_ids"), SERVER, API_ENGINE,
      note="a request's stop_token_ids ignored"),
    m("protocol", PROTO, GIVEN, ignoring("ignore_eos"), SERVER, API_ENGINE,
      note="a request's ignore_eos ignored"),
    m("protocol", PROTO, GIVEN, ignoring("gamma"), SERVER, API_ENGINE,
      note="a request's gamma ignored"),
    m("protocol", REQ, 'choice_seed(seed, i)", low=1, high=MAX_N)', 'choice_seed(seed, i)", low=0, high=MAX_N)',
      SERVER, "tests/simsd/entrypoints/test_n.py", note="n = 0 accepted"),
    m("memory", "simsd/engine/memory.py", "if free is not None and est.needed(device) > free:",
      "if free is not None and est.needed(device) >= free:", MEMORY,
      note="a run that needs exactly the free memory refused"),
    m("memory", "simsd/entrypoints/resources.py",
      "row_bytes = sum(kv_cache_bytes(cfg, dtype, 1, capacity + margin)",
      "row_bytes = sum(kv_cache_bytes(cfg, dtype, 1, capacity)", API,
      note="kv_cache_memory: a row's bytes without the query margin (more rows than fit)"),
    m("backend self-check", "simsd_kernels/selfcheck.py",
      'poisoned[3] = to(k_cache.masked_fill(unread[..., None, None], float("nan")))', "poisoned[3] = clean[3]",
      SELFCHECK, note="unread K cache slots not poisoned (a backend reading K past cache_seqlens passes)"),
    m("backend self-check", "simsd_kernels/selfcheck.py", "tol = 2 * baseline.max_err + ERR_FLOOR[q.dtype]",
      "tol = 2 * baseline.max_err + 100 * ERR_FLOOR[q.dtype]", SELFCHECK,
      note="the error floor 100x too loose (bfloat16: 1.6, an output off by 0.5 passes)"),
    m("tp check", "simsd/engine/tp.py", '("num_key_value_heads", c.num_key_value_heads),', "", TP,
      note="--tp 2 on an odd number of KV heads not refused (a head dropped)"),
    m("prompt bounds", "simsd/decoding/config.py",
      "bad = [t for t in prompt_ids if not 0 <= int(t) < config.vocab_size]",
      "bad = [t for t in prompt_ids if not 0 <= int(t) <= config.vocab_size]", API, PROMPTS, CLI, VANILLA,
      note="a prompt id equal to the vocabulary size accepted by the decoders (an IndexError later)"),
    m("prompt bounds", "simsd/decoding/config.py", "if P >= limit:", "if P > limit:",
      API, REF, note="a prompt of the model's full length refused as 'prompt + max_new_tokens' (wrong field)"),
    m("prompt bounds", "simsd/decoding/config.py", "if P + max_new_tokens > limit:",
      "if P + max_new_tokens >= limit:", API, REF,
      note="prompt + max_new_tokens == the model's length refused"),
    m("prompt bounds", "simsd/decoding/config.py", "if total > config.max_position_embeddings:",
      "if total >= config.max_position_embeddings:", API, REF,
      note="whole blocks that end exactly at the model's length refused"),
    m("prompt bounds", "simsd/decoding/config.py", 'limit, what = max_model_len, opt("max_model_len")',
      'limit, what = max_model_len + 1, opt("max_model_len")', API,
      note="a prompt of max_model_len tokens refused as max_tokens (wrong field)"),
    m("prompt bounds", "simsd/entrypoints/builder.py", "if default_params.max_tokens >= max_model_len:",
      "if default_params.max_tokens > max_model_len:", SERVE_CLI,
      note="serve starts with --max-tokens equal to --max-model-len (every request without max_tokens refused)"),
    m("stop-id bounds", REQ, "any(t >= s.vocab_size for t in s.stop_token_ids)",
      "any(t > s.vocab_size for t in s.stop_token_ids)", API,
      note="a stop id equal to the vocabulary size accepted"),
    m("stop-id bounds", REQ, '"output)", low=0, many=True)', '"output)", low=-1, many=True)',
      API, note="a stop id of -1 accepted"),
    m("prompt bounds", SPECS, "None not in (s.gamma, s.block_length) and s.gamma > s.block_length",
      "None not in (s.gamma, s.block_length) and s.gamma >= s.block_length", API, API_ENGINE,
      note="gamma equal to the block length refused"),
    m("prompt bounds", SPECS, "None not in (s.gamma, s.max_gamma) and s.gamma > s.max_gamma",
      "None not in (s.gamma, s.max_gamma) and s.gamma >= s.max_gamma",
      API_ENGINE, note="gamma equal to the LLM's max_gamma refused"),
    m("batch retry", "simsd/engine/scheduler.py",
      "row.cached[name], row.forwards[name], row.query_tokens[name] = cached, forwards, tokens",
      "row.forwards[name], row.query_tokens[name] = forwards, tokens", SCHED,
      note="after a failed step of a folded commit the innocent rows' cached lengths stay advanced"),
    m("graph self-check", GR, "diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0",
      "diff = (a.double() - b.double()).max().item() if a.numel() else 0.0", GRAPH_CHECK,
      note="the replay's difference signed (a replay that writes K/V too small passes)"),
    # issue 24, the model half: the attention door, the torch backend's plan, merged projections --------
    m("attention door", "simsd_kernels/torch_backend.py",
      "slots = cache_seqlens.to(torch.int64)[:, None] + torch.arange(Lq, device=device)",
      "slots = cache_seqlens.to(torch.int64)[:, None] + torch.arange(1, Lq + 1, device=device)", DOOR,
      note="the torch door writes the new K/V one slot too far"),
    m("attention door", "simsd_kernels/torch_backend.py", "if self.mode in (MaskMode.BIDIRECTIONAL, MaskMode.PAPER):",
      "if self.mode in (MaskMode.BIDIRECTIONAL, MaskMode.PAPER, MaskMode.EXACT):", DOOR, ROWS,
      note="exact mode through the unmasked per-run SDPA path (copies see each other)"),
    m("attention door", "simsd_kernels/metadata.py",
      "if got != self._shapes or not self._fits(k_cache, v_cache) or q.dtype != self.dtype:", "if False:",
      DOOR, note="a layer's tensors of other shapes than the forward was prepared for accepted"),
    m("attention door", "simsd_kernels/rope.py", "return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)",
      "return cos, torch.cat((sin[..., :half], -sin[..., half:]), dim=-1)", DOOR,
      note="the signed sine's sign on the wrong half (RoPE by the negated angle)"),
    m("merged projections", "simsd/models/model.py", "for name, part in zip(parts, w.split(sizes(), 0)):",
      "for name, part in zip(parts[::-1], w.split(sizes()[::-1], 0)):", FWD_CTX,
      note="state_dict splits the merged rows in the reverse order (k and v or gate and up swapped)"),
    m("merged projections", "simsd/engine/tp.py", "((Hq + rank * hkv) * D, (Hq + (rank + 1) * hkv) * D),",
      "((Hq + rank * hq) * D, (Hq + (rank + 1) * hq) * D),", TP,
      note="a rank's k rows of the merged q/k/v projection cut by the q head count"),
    # issue 28: paper mode as the release runs it, and simsd eval --------------------------------------------
    m("release", VER, "before = proposed & (index < first)", "before = proposed & (index <= first)", RELEASE,
      note="the rejected proposal counted as accepted"),
    m("release", VER, "first = torch.where(proposed & ~ok, index, L).min()",
      "first = torch.where(~ok, index, L).min()", RELEASE, note="a known position's verdict read"),
    m("release", VFY, "k = math.ceil(masks / max(cfg.steps - c, 1))", "k = math.ceil(masks / max(cfg.steps, 1))",
      RELEASE, note="the fresh schedule does not count down its steps"),
    m("release", VFY, "return [i for i, t in enumerate(tau) if t <= n]", "return super().acceptance_order(tau, n)",
      RELEASE, note="the release's accepted tokens marked in temporal order (from_draft)"),
    m("release", "simsd/decoding/step.py",
      "key = (c.block_length, tuple(c.schedule), c.strategy, c.threshold, c.sampling, s.mask_id)",
      "key = (c.block_length, c.steps, c.strategy, c.threshold, c.sampling, s.mask_id)", RELEASE,
      note="rows whose fresh schedules differ batched as one step"),
    m("release", "simsd/speculative/decoder.py",
      "self.verifier_class = PAPER_VERIFIERS[spec.paper_variant] if spec.mode == \"paper\" else VERIFIERS[spec.mode]",
      "self.verifier_class = VERIFIERS[spec.mode]", PAPER_VARIANT, note="the variant ignored"),
    m("eval", "simsd/entrypoints/eval.py", "if recorded.get(key) != settings.get(key):",
      "if False and recorded.get(key) != settings.get(key):", EVAL, note="a run resumed with other settings"),
    m("eval", "simsd/entrypoints/eval.py",
      "todo = [i for i, p in enumerate(prompts) if not all(m in records.get(p.id, {}).get(\"results\", {}) "
      "for m in modes)]",
      "todo = list(range(len(prompts)))", EVAL, note="a resumed run decodes everything again"),
    m("eval", "simsd/entrypoints/eval.py",
      "return None if prompt.answer is None else answer_matches(text, prompt.answer)",
      "return None", EVAL, note="nothing scored"),
    m("eval", "simsd/entrypoints/scoring.py", "if got == form:", "if got == form and False:", SCORING,
      note="only numbers match"),
    m("eval", "simsd/entrypoints/scoring.py",
      "return [normalize_answer(a) for a in _ALTERNATIVES.split(answer) if a.strip()]",
      "return [normalize_answer(answer)]", SCORING, note="a reference's alternative forms dropped"),
    # issue 24, the thin layer: the merged q/k norm weight, the torch door's joint rotation ---------------
    m("thin layer", "simsd/models/model.py",
      "key = (qw._version, kw._version, qw.data_ptr(), kw.data_ptr(), qw.dtype, self.num_heads, self.num_kv_heads)",
      "key = (qw.data_ptr(), kw.data_ptr(), qw.dtype, self.num_heads, self.num_kv_heads)", FWD_CTX,
      note="the merged q/k norm weight kept after a norm weight changed in place"),
    m("thin layer", "simsd_kernels/torch_backend.py", "qr, kr = rotate(qk, self.cos, self.sin).split([Hq, Hkv], 2)",
      "qr, kr = rotate(qk, self.cos, self.sin).split([Hq, Hkv], 2)[::-1]", FWD_CTX, DOOR,
      note="the jointly rotated q and k swapped"),
    # issue 26, the server facing a network ----------------------------------------------------------
    m("server", MIDDLEWARE,
      'if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.want):',
      'if scheme.lower() != "bearer" and not hmac.compare_digest(token.strip().encode(), self.want):', SERVER,
      note="any Bearer token accepted"),
    m("server", MIDDLEWARE, "if total > self.limit:", "if total > 4 * self.limit:", SERVER,
      note="a chunked body read past the limit"),
    m("server", OSTATE, "room = s.max_rows + s.max_waiting",
      "room = s.max_rows + 2 * s.max_waiting", SERVER,
      note="a request that can never be queued gets 503, not 400"),
    m("server", OERRORS, 'state.metrics.rejected.labels("queue_full").inc()',
      'state.metrics.rejected.labels("shutting_down").inc()', SERVER, note="queue-full refusals counted as shutdown"),
    m("server", "simsd/entrypoints/request_builder.py",
      "if fit_max_tokens and 0 < room < params.max_tokens:",
      "if fit_max_tokens and 0 < room < params.max_tokens - 1:", SERVER,
      note="an omitted max_tokens fitted one position short of the refusal"),
    m("server", PROTO, "elif v is not None:", "else:", SERVER, note="an explicit null refused instead of the default"),
    m("server", PROTO, "if self.name is not None:  # the chat template sees it, as simsd's API passes it",
      "if False:", SERVER, note="a message's name dropped"),
    m("server", OSTATE, "await asyncio.wait_for(self._idle.wait(), timeout)",
      "await asyncio.wait_for(self._idle.wait(), timeout + 60)", SHUTDOWN,
      note="the drain's deadline 60 s late"),
    m("server", "simsd/entrypoints/encoding.py", 'return most * (NFC_SHRINK if norm == "NFC" else 1)',
      "return most", LENGTH, note="the NFC shrink left out of the length bound"),
    m("server", "simsd/models/loading.py",
      "for raw, where in ((generation_raw, path / \"generation_config.json\"), (config_raw, path / \"config.json\")):",
      "for raw, where in ((generation_raw, path / \"generation_config.json\"),):", LOADING,
      note="config.json's eos ids left out of the stop ids"),
    m("non-finite", BAT, "bad = (s - s).masked_fill_(mask, 0).sum(-1)  # mask: True where the requests did NOT ask",
      "bad = (s - s).masked_fill_(mask, 0).sum(-1).nan_to_num(0.0)", NONFINITE, note="non-finite logits never flagged"),
    m("non-finite", BAT, "host[j, s:e] = False", "host[j, s:e - 1] = False", NONFINITE,
      note="a request's last logit position not looked at"),
    # issue 29, Ray and torchrun ----------------------------------------------------------------------
    m("ray", "simsd/entrypoints/ray_data.py", "for i, out in zip(indices, chunk[args.mode]):",
      "for i, out in zip(indices[::-1], chunk[args.mode]):", RAY, note="a chunk's outputs put back reversed"),
    m("ray", "simsd/entrypoints/ray_cluster.py", 'return {"num_cpus": config.threads or 1, "num_gpus": len(cuda)}',
      'return {"num_cpus": config.threads or 1, "num_gpus": min(len(cuda), 1)}', RAY,
      note="one GPU asked for a replica that names two"),
    m("ray", "simsd/entrypoints/cli.py", "if index >= n:", "if index > n:", RAY,
      note="a CUDA index just outside the actor's GPUs accepted"),
    # issue 34, the device run ---------------------------------------------------------------------
    m("moe self-check", "triton_ops/fused_moe.py", "return pairs.to(tl.int64), pairs < num_pairs, offs_n, offs_n < N",
      "return pairs.to(tl.int64), (pairs < num_pairs) & (tl.arange(0, BLOCK_M) < 16), offs_n, offs_n < N", FUSED_MOE,
      note="the fused MoE drops tile rows past 16 (right at 16-row tiles, NaN at 32 and 64)"),
    m("moe self-check", "simsd_kernels/moe.py", "(64, 80, 48, 6, 2), (100, 96, 40, 4, 2))",
      "(64, 80, 48, 6, 2), (70, 128, 64, 16, 2))", FUSED_MOE, note="the fused MoE's self-check without a 64-row tile"),
    m("graph self-check", GR, 'if name == "torch":', 'if name == "torch" and requested == "torch":', GRAPH_CHECK,
      note="a MoE model whose auto experts fell back to torch accepted for graphs"),
    m("graph self-check", GR, "check_moe_graphable(model.modules(), device, model.dtype)",
      "check_moe_graphable([], device, model.dtype)", GRAPH_CHECK, note="check_graphable skips the MoE layers"),
    m("graph self-check", "simsd_kernels/moe.py", 'why = "" if ok else f"triton failed its self-check: {why}"',
      'why = "" if ok else "triton failed its self-check"', GRAPH_CHECK,
      note="the MoE refusal without the failed self-check's case"),
    m("device run", "bench/device_tests.py", "busiest = max(open_groups, key=lambda name: work[name] / shares[name])",
      "busiest = max(open_groups, key=lambda name: len(ids[name]) / shares[name])", DEVICE_RUN,
      note="device test shards dealt by count again"),
    m("device run", "bench/device_tests.py", "open_groups = [name for name in work if shares[name] < len(ids[name])]",
      "open_groups = list(work)", DEVICE_RUN, note="a group dealt more shards than tests"),
    m("device run", "bench/device_lib.sh", 'tmp=$(mktemp "$LOGS.tar.XXXXXX") || return 1', 'tmp="$LOGS.tar.gz"',
      DEVICE_LIB, note="concurrent log packs share one temporary archive"),
    m("device run", "bench/device_lib.sh", "left=$((left - E2E_FLOOR))", "left=$((left - 0))", DEVICE_LIB,
      note="bench-e2e's floor not kept by the earlier steps"),
    m("device run", "bench/device_run.sh", "BENCH_E2E=(--quick --target-shape 8b,30b-a3b)", "BENCH_E2E=(--quick)",
      DEVICE_LIB, note="the GPU run's bench_e2e without the 30B-A3B-shaped target"),
    m("check rows", "simsd_kernels/check.py", 'status="pass" if res.ok else "FAIL", max_err=num(res.max_err)',
      'status="pass", max_err=num(res.max_err)', CHECK, note="a failed fused-MoE check written as a pass row"),
    m("check rows", "bench/device_summary.py", 'verdict = "wrong" if fails else ("correct" if mine else "not run")',
      'verdict = "correct" if mine else "not run"', CHECK, note="the device table's fused-MoE path never wrong"),
    m("interpreter", "simsd_kernels/triton_backend.py", "if _major_minor(triton_version) < (3, 7)",
      "if _major_minor(triton_version) < (3, 6)", "tests/kernels/test_triton_backend.py",
      note="Triton 3.6's interpreter accepted under NumPy 2.4"),
    m("packaging", "setup.py", 'return {"license_expression": LICENSE} if version >= SETUPTOOLS_PEP639 else',
      'return {"license_expression": LICENSE} if version >= (0, 0) else', "tests/test_packaging.py",
      note="PEP 639's license_expression given to setuptools < 77"),
    m("device run", "simsd/entrypoints/bench.py", "if os.environ.get(GIT_SHA_ENV, \"\").strip():", "if False:",
      DEVICE_LIB, note="the sha passed in to a copy without .git ignored"),
    # issue 34 item 0, first use ---------------------------------------------------------------------
    m("first use", "simsd/entrypoints/builder.py",
      "    check_llm_memory(config, infos, size)\n", "    size\n", MEMORY,
      note="LLM and simsd serve load weights without checking they fit"),
    m("first use", "simsd/entrypoints/resources.py", 'if getattr(infos[role], "model", None) is None:',
      "if False:", MEMORY, note="the weights left out of the LLM's estimate"),
    m("first use", "simsd/entrypoints/resources.py",
      "fits(max_model_len=n), config.block_length + 1, config.max_model_len - 1)",
      "fits(max_model_len=n), config.block_length + 1, config.max_model_len // 2)", MEMORY,
      note="the max_model_len hint not the largest that fits"),
    m("first use", "simsd/decoding/config.py",
      'raise ParamError("max_tokens", f"prompt ({P} tokens) + {opt(\'max_tokens\')} ({max_new_tokens}) exceeds "',
      'raise ParamError("max_tokens", f"prompt ({P} tokens) + max_new_tokens ({max_new_tokens}) exceeds "',
      CLI, note="a prompt too long for max_tokens names max_new_tokens, not the option typed"),
    m("first use", "simsd/models/loading.py", 'if not (path / "tokenizer.json").is_file():',
      'if (path / "tokenizer.json").is_file():', LOADING, note="a missing tokenizer.json not named"),
    # issue 35 item 5, decoding rules in decoding/ -------------------------------------------------------
    m("one decoder", "simsd/speculative/decoder.py", "return SpecRow(self, plan or self.plan, row,",
      "return SpecRow(self, self.plan, row,", DRIVER, note="a request's plan ignored: rows run the decoder's gamma"),
    # issue 35 item 4, one door per backend ------------------------------------------------------------
    m("one door", "simsd_kernels/metadata.py", "if cls.head_dims is not None and head_dim not in cls.head_dims:",
      "if False:", SELFCHECK, note="the one support rule ignores the head dims (auto runs a kernel on head_dim 48)"),
    m("one door", "simsd_kernels/torch_backend.py",
      "self._write(rotate(k[:, :n], self.cos[:, :n], self.sin[:, :n]), v[:, :n], k_cache, v_cache, n)",
      "self._write(k[:, :n], v[:, :n], k_cache, v_cache, n)", DOOR,
      note="the torch door's write of part of the tokens leaves k unrotated"),
    m("one door", GR, "if not backend.fused:", "if False:", GRAPH_CHECK,
      note="a model whose attention runs on the torch reference accepted for CUDA graphs"),
    m("one door", "simsd/engine/memory.py", "return not model.attention_backend_class().fused", "return False",
      MEMORY, note="the memory check counts no dense attention workspace for the torch reference"),
    # issue 36, self-speculation, trees, lookahead, width -------------------------------------------------
    m("self draft", VER, "reached = ~(path & ~ok[None, :]).any(-1)", "reached = ok", VERDICT, EXACT_REF,
      note="a tree node valid when it is its parent's step, whatever its ancestors"),
    multi("mask rule (all mirrors)", [
        (MR, "((grp_k < grp_q) & (grp_q <= tau_k))", "((grp_k < grp_q) & (grp_q < tau_k))"),
        (TR, "((grp_k < grp_q) & (grp_q <= tau_k))", "((grp_k < grp_q) & (grp_q < tau_k))"),
        (CR, "(gk < gq && gq <= tk)", "(gk < gq && gq < tk)"),
    ], MASKS, MIRROR, FLEX, note="a tree copy does not see its ancestor when it is the ancestor's last descendant"),
    m("self draft", "simsd/speculative/tree.py", "scores.topk(rank).indices[rank - 1].view(1)",
      "scores.topk(rank + 1).indices[rank].view(1)", TREE,
      note="a token alternative skips a rank (the third token where the runner-up belongs)"),
    m("lookahead", SR, 'self.row.truncate("target", self.row.cached["target"] - L)',
      'self.row.truncate("target", self.row.cached["target"])', SELF,
      note="a proposed finished block that was not committed stays in the cache"),
    m("lookahead", SR, "if node in verdict.finished:  # finished as proposed", "if True:  # finished as proposed", SELF,
      note="the next block begun from a lookahead whose finished block was rejected"),
    m("lookahead", SD, "[self.key(rnd.start)] * C + [self.key(rnd.start + L)] * sum(n)",
      "[self.key(rnd.start)] * C + [self.key(rnd.start)] * sum(n)", SELF,
      note="the next block's first step (every next-block chain copy) drawn with this block's noise key"),
    m("lookahead", SR, "self.stats.lookahead_blocks += 1", "self.stats.lookahead_blocks += 0", SELF,
      note="lookahead_blocks never counts"),
    m("width", "simsd/speculative/width.py", "if copies + cost > cap:", "if copies + cost > cap + 1:", WIDTH,
      note="--speculation-width N lets N + 1 copies through"),
    m("width", "simsd/speculative/width.py", "copies = 1 if rest else 2", "copies = 1", WIDTH,
      note="a lookahead's two extra copies left out of the width"),
    m("width", "simsd/engine/costs.py", "b = max(0.0, sum(", "b = (sum(", WIDTH,
      note="a forward's fitted cost per query token may be negative"),
    m("device emulation", "tests/device_emulation.py", "if placed_in and name not in ALLOWED:",
      "if False:", "tests/test_device_emulation.py", note="a host tensor meets a placed one unnoticed"),
    m("device run", "bench/device_tests.py", "self.proc.returncode != BROKEN_CONTEXT and", "True and", DEVICE_RUN,
      note="a shard stopped for a broken CUDA context blames a crash as well"),
    # issue 34 items 7-12, the server's last open doors ------------------------------------------------
    m("server doors", REQ, "lambda s: len(s.stop) > MAX_STOP_STRINGS,", "lambda s: len(s.stop) > 2 * MAX_STOP_STRINGS,",
      SURFACES,
      note="17 stop strings taken"),
    m("server doors", REQ, "lambda s: _stop_chars(s) > MAX_STOP_CHARS,",
      "lambda s: _stop_chars(s) > MAX_STOP_CHARS + 1,", SURFACES,
      note="stop strings of 1025 characters in all taken"),
    m("server doors", PROTO, "kept[k], unknown = v, True", "kept[k], unknown = v, False", DOORS,
      note="every unknown field validated (400,000 errors built to report the first)"),
    m("server doors", PROTO, "FAIL_FAST = _FailFast()", "FAIL_FAST = _FailFast(fail_fast=False)", DOORS,
      note="a list validated past its first bad item"),
    m("server doors", SERVING, "body, prompts = await run_in_threadpool(parsed, model, raw)",
      "body, prompts = parsed(model, raw)", DOORS, note="a body parsed and validated on the event loop"),
    m("server doors", "simsd/entrypoints/openai/api_server.py", 'allowed_origins=(), allowed_headers=("*",)',
      'allowed_origins=(), allowed_headers=("Authorization", "Content-Type")', DOORS,
      note="CORS allows only Authorization and Content-Type by default (the SDK's preflight refused)"),
    m("server doors", CONNECTION, "if (end.end() if end else len(head)) <= limit:", "if end or len(head) <= limit:",
      CONNECTED, note="a long head bounded only while incomplete (h11's own bound: one read passes it)"),
    m("server doors", CONNECTION, "self.arm_read_deadline()  # (from its first byte after a keep-alive pause)",
      "pass", CONNECTED, note="no read deadline for a request after a keep-alive pause"),
    m("server doors", CONNECTION, "if self.conn.their_state is not h11.SEND_BODY:",
      "if self.conn.their_state is not h11.SEND_BODY and False:", CONNECTED,
      note="the read deadline cuts a stream whose request arrived whole"),
    m("server doors", "simsd/config/serving.py",
      'bad = next((i for i, c in enumerate(key) if not " " <= c <= "~"), None)',
      'bad = next((i for i, c in enumerate(key) if not " " <= c <= "\\U0010ffff"), None)', DOORS, SERVE_CLI,
      note="a non-ASCII API key accepted (it can never match)"),
    m("server doors", "simsd/entrypoints/serve.py", "    api_key_of(args)  # before the models load", "    pass  #",
      SERVE_CLI, note="the API key checked only after the models load"),
    m("server doors", "simsd/entrypoints/cli.py", "lambda a: bool(a.http_given) and a.ray,",
      "lambda a: bool(a.http_given) and False,", SERVE_CLI,
      note="--max-header-bytes and --request-read-timeout taken with --ray (Ray's proxy reads the requests)"),
    m("server doors", SERVING, "done, _ = await asyncio.wait({get}, timeout=state.sse_keepalive)",
      "done, _ = await asyncio.wait({get}, timeout=None)", DOORS, note="a queued stream gets no keep-alive"),
    m("server doors", "simsd/engine/scheduler.py", "self.round_started = time.monotonic()", "self.round_started = None",
      DOORS, note="/health 200 while a round hangs"),
    m("server doors", OERRORS, 'headers={"x-should-retry": "false"}', "headers=None", NONFINITE,
      note="a failed request's 500 retried by the openai client"),
    m("server doors", PROTO,
      "return [ChatPrompt(self.chat(), self.add_generation_prompt, self.continue_final_message)]",
      "return [ChatPrompt(self.chat(), self.add_generation_prompt)]", DOORS,
      note="continue_final_message ignored"),
    m("server doors", "simsd/entrypoints/encoding.py", "if self.add_generation_prompt and self.continue_final_message:",
      "if False:", DOORS, note="continue_final_message with add_generation_prompt not refused by name"),
    # issue 35 item 3: the refused combinations as rule tables ----------------------------------------
    m("rules table", REQ, "check_rules(SPECULATIVE_RULES + REQUEST_RULES, params, config",
      "check_rules(REQUEST_RULES, params, config", SURFACES,
      note="a request's speculative settings not checked against its engine (left to the decoder)"),
    m("rules table", "simsd/config/engine.py", 'check_rules(SPECULATIVE_RULES + ENGINE_RULES, self, {"apart": apart})',
      'check_rules(ENGINE_RULES, self, {"apart": apart})', SURFACES, OPTIONS,
      note="an engine's speculative combinations (release with fallback, draft=self with a draft device) taken"),
    m("rules table", "simsd/config/engine.py", 'Rule("scheduler_thread", lambda s: s.scheduler_thread and s.tp > 1,',
      'Rule("scheduler_thread", lambda s: s.scheduler_thread and s.tp > 2,', SURFACES,
      note="scheduler_thread with tp 2 taken (the ranks would run different rounds)"),
    m("rules table", "simsd/entrypoints/cli.py", 'Rule("limit", lambda a: a.single and a.limit is not None,',
      'Rule("limit", lambda a: False,', "tests/simsd/entrypoints/test_settings.py",
      note="--limit with a single prompt taken (it would have no effect)"),
    m("rules table", SPECS, "Rule(name, lambda s, name=name: is_self_draft(s.draft) and getattr(s, name) not in "
      "(None, False),", "Rule(name, lambda s, name=name: is_self_draft(s.draft) and getattr(s, name) not in "
      "(None, False, True),", SURFACES, SELF, note="optimistic=True with draft='self' taken"),
    m("rules table", "simsd/speculative/decoder.py", '{"draft": SELF_DRAFT if self.self_draft else None,',
      '{"draft": None,', SELF, note="the decoder runs a self-speculative request's draft settings unchecked"),
    # issue 36: more alternatives beside a step ------------------------------------------------------
    m("self draft", "simsd/speculative/tree.py", ".topk(skip - 1).indices])", ".topk(0).indices])", TREE,
      note="the alternative leaving out two positions leaves out one (the first alternative again)"),
    m("self draft", "simsd/speculative/self_draft.py", "children[p] = dict(zip(kinds, cands))",
      "children[p] = dict(zip(wanted, cands))", TREE,
      note="a node's kind is its place among the kinds asked, not the kind of the candidate (one did not apply)"),
    m("self draft", "simsd/speculative/width.py", "            if parent[j] in on_path:", "            if True:",
      WIDTH, note="the children of a node that was not valid counted as tried and failed"),
    # issue 36: best-first trees, the next block's predictions kept ---------------------------------
    m("best first", "simsd/speculative/width.py", "heapq.heappush(heap, (-value[j] * rates[d - 1][k] / copies,",
      "heapq.heappush(heap, (-rates[d - 1][k] / copies,", WIDTH,
      note="a candidate valued by its own rate, not its path's (a deep node before a likelier shallow one)"),
    m("best first", "simsd/speculative/width.py", "if rest == 0 and not lookahead:", "if False:", WIDTH,
      note="a node that fills the block grown without a lookahead (a copy for no step)"),
    m("best first", "simsd/speculative/width.py", 'if self.width == "auto" and (steps - gain * cost)',
      'if False and (steps - gain * cost)', WIDTH, note="auto keeps the whole budget whatever a copy costs"),
    m("best first", "simsd/speculative/width.py", "rates = [self.rates(masks, d) for d in",
      "rates = [self.rates(4, d) for d in", WIDTH, note="a round's tree planned with another MASK count's rates"),
    m("best first", "simsd/speculative/tree.py", "(not skip or (positional and (masks is None or masks > skip)))",
      "(not skip or (positional and (masks is None or masks >= skip)))", WIDTH,
      note="a position alternative planned where it leaves no MASK to reveal"),
    m("best first", SD, "            self.logits = self.upcoming", "            self.logits = None", SELF,
      note="a block no lookahead began proposes nothing in its first round"),
    m("best first", SD, "self.draft.upcoming = logits.index_select(0, starts.index_select(0, near))[0]",
      "self.draft.upcoming = None", SELF,
      note="the rolled-back lookahead's next-block predictions not kept"),
    m("draft alternatives", "simsd/speculative/spec_row.py",
      "self.alternatives = min(LOGIT_ALTERNATIVES, max(0, (int(width) - plan.gamma - 1) // plan.gamma))",
      "self.alternatives = 0", "tests/simsd/speculative/test_draft_alternatives.py",
      note="--speculation-width N with a draft model ignored (the chain only)"),
    m("draft alternatives", "simsd/speculative/spec_row.py", "copies += [chain.copies[c + 1]] * len(kinds)",
      "copies += [True] * len(kinds)", "tests/simsd/speculative/test_draft_alternatives.py",
      note="an alternative that fills the block gets a verify copy (a target step on a full block)"),
    m("draft alternatives", "simsd/speculative/tree.py", 'scores = scores.index_fill(0, new[at], float("-inf"))',
      "pass", TREE, "tests/simsd/speculative/test_draft_alternatives.py",
      note="a token alternative may repeat the token the step took (two valid siblings)"),
    m("logprobs", VER, "score = ((states == mask_id) & on_path[:, None]).long() * (depth[:, None] + 1)",
      "score = ((states == mask_id) & on_path[:, None]).long() * (1 - depth[:, None])", LOGPROBS_MODES,
      note="exact mode reads a token's logprobs from the shallowest masked copy, not the one that revealed it"),
    m("logprobs", "simsd/speculative/spec_row.py", "blk.lp.note(logits, block, block != self.mask_id)", "pass",
      LOGPROBS_MODES, note="a lookahead round's first step of the next block leaves its tokens unscored"),
    m("logprobs", "simsd/decoding/prompt_logprobs.py",
      "states = [block[:j] + [mask_id] * (L - j) for j in range(first, n)]",
      "states = [block[:j + 1] + [mask_id] * (L - j - 1) for j in range(first, n)]",
      "tests/simsd/decoding/test_logprobs.py", note="a prompt token scored with itself revealed"),
    m("logprobs", "simsd/decoding/logprobs.py", "lp = torch.log_softmax(logits.float(), dim=-1)",
      "lp = torch.log_softmax(logits.float() / 0.9, dim=-1)", "tests/simsd/decoding/test_logprobs.py",
      note="logprobs of a temperature-scaled distribution, not the raw one"),
    # issue 38: penalties, response_format, the one default mode --------------------------------------
    m("penalties", "simsd/decoding/penalties.py", "logits.mul_(torch.where(logits > 0, 1.0 / r, r))",
      "logits.mul_(torch.where(logits > 0, r, 1.0 / r))", PENALTIES,
      note="the repetition penalty raises a repeated token's positive logit (the factor inverted)"),
    m("penalties", "simsd/decoding/penalties.py", "revealed = torch.where(h.output, states[a:b], h.mask_id)",
      "revealed = states[a:b]", PENALTIES, note="the prompt tail that opens the first block counted as output"),
    m("penalties", "simsd/decoding/penalties.py", "seen[a:b].index_fill_(1, h.prompt, True)", "pass", PENALTIES,
      note="the prompt's tokens not counted by the repetition penalty"),
    m("penalties", "simsd/decoding/penalties.py", "tokens = torch.cat([h.tokens, torch.where(h.output, block, "
      "self.mask_id)])", "tokens = h.tokens", PENALTIES, note="finished blocks never counted as output"),
    m("penalties", SD, "history = [rnd.history] * C + [rnd.history.after(tree.states[f]) for i, f in",
      "history = [rnd.history] * C + [rnd.history for i, f in", EXACT_PENALTIES,
      note="a lookahead's next-block copy penalised without the proposed finished block"),
    m("response format", "simsd/config/vllm_names.py", '"response_format": Lacks(STRUCTURED, (TEXT, None), "OpenAI"),',
      '"response_format": Lacks(STRUCTURED, (TEXT, None, {"type": "json_object"}), "OpenAI"),', PENALTIES,
      "tests/simsd/entrypoints/openai/test_penalties_format.py", note="a JSON response_format taken (plain text sent)"),
    m("default mode", "simsd/entrypoints/builder.py",
      "return DEFAULT_DRAFT if Path(target).resolve() == DEFAULT_TARGET.resolve() else SELF_DRAFT",
      "return DEFAULT_DRAFT", "tests/simsd/entrypoints/test_cli.py",
      note="any target paired with the bundled tiny draft by default (refused: not its draft)"),
    # issue 37 item 1: the paged door ----------------------------------------------------------------
    m("paged door", "simsd_kernels/paging.py", "return block_table[rows, slots // page_size].to(torch.int64), "
      "slots % page_size", "return block_table[rows, slots // page_size].to(torch.int64), slots % (page_size + 1)",
      PAGED_DOOR, note="the torch door's page offsets wrong past a row's first page"),
    m("paged door", "simsd_kernels/torch_backend.py",
      "if self.pages[rows] == list(range(first, first + rows.stop - rows.start)):", "if True:", PAGED_DOOR,
      PAGED_CACHE, note="rows whose one-page tables are not consecutive read in place as if they were"),
    m("paged door", "triton_ops/common.py", "page = tl.load(bt_row + n // page_size, mask=ok, other=0).to(tl.int64)",
      "page = tl.load(bt_row, mask=ok, other=0).to(tl.int64)", PAGED_DOOR,
      note="the Triton door reads every key from the row's first page"),
    m("paged door", "simsd/models/pages.py", "            heapq.heappush(self._free, p)", "            pass",
      PAGED_CACHE, note="a released row's pages never return to the pool"),
    # issue 37 item 3: the prefix cache -------------------------------------------------------------
    m("prefix cache", "simsd/models/pages.py", "self._unused.pop(p, None)", "pass", PAGED_CACHE,
      note="a shared cached page stays evictable while a row holds it"),
    m("prefix cache", "simsd/models/pages.py", "            if self._refs[p]:\n                continue",
      "            if False:\n                continue", PAGED_CACHE,
      note="a page another row still holds is given back when one of its rows ends"),
    m("prefix cache", "simsd/models/pages.py", "            if p in self._key_of:\n", "            if False:\n",
      PAGED_CACHE, note="a cached page is forgotten when its last row ends"),
    m("prefix cache", "simsd/models/pages.py", "del self._page_of[self._key_of.pop(p)]", "self._key_of.pop(p)",
      PAGED_CACHE, note="an evicted page still found under its old key"),
    m("prefix cache", "simsd/models/pages.py", "prev = hashlib.sha256(prev + array(", "prev = hashlib.sha256(array(",
      PAGED_CACHE, note="a page's key ignores the pages before it"),
    # issue 37 item 4: chunked prefill --------------------------------------------------------------
    m("chunked prefill", BAT, "aged = [i for i, n in (waited or {}).items() if i in pending and n >= MAX_WAIT]",
      "aged = []", CHUNKED, note="no ageing: a request passed over for MAX_WAIT rounds does not go first"),
    m("chunked prefill", BAT, "waits = {g[2][0] for g in groups if pending[g[2][0]][1].prefill and g[2][0] in held}",
      "waits = set()", CHUNKED, note="a row's prefill chunks run back to back while other rows wait"),
    m("chunked prefill", BAT, "end = min(start + chunk, aligned)", "end = min(start + chunk, aligned - 1)",
      CHUNKED, note="the last chunk stops a token short of the block-aligned prompt"),
    m("chunked prefill", BAT, "if name in self.graphs and not prefill:", "if name in self.graphs:", CHUNKED,
      note="prefill chunks replayed as CUDA graphs (a graph per chunk width)"),
    m("chunked prefill", "simsd/engine/scheduler.py", "self.prefill_seconds += end - start",
      "self.prefill_seconds += 0.0", SCHED, API_ENGINE, note="prefill rounds counted as decode time"),
    # issue 37 items 1-3: the engine over a shared page pool -------------------------------------------
    m("engine pages", "simsd/engine/scheduler.py", "                self.engine.reserve(name, reqs)\n",
      "                pass\n", PAGED_ENGINE, KV_PAGES,
      note="no preemption: a forward whose rows cannot grow fails them (PagesExhausted)"),
    m("engine pages", BAT, "slots = capacity + margin if page_size is None else -(-(capacity + margin) // page_size) "
      "* page_size", "slots = capacity + margin", KV_PAGES, note="a row's slots not rounded up to whole pages"),
    m("engine pages", "simsd/models/cache.py", "self.block_table[row].fill_(self.scratch)", "pass", PAGED_CACHE,
      note="a released row's table still names the pages it gave back"),
    m("engine pages", "simsd/engine/scheduler.py", "if need > budget and (admits or len(self._running) > "
      "len(cancels)):", "if False:", PAGED_ENGINE, note="requests admitted whatever the free pages"),
    m("engine pages", "simsd/entrypoints/outputs.py", "            return False\n        self._blocks.append",
      "            pass\n        self._blocks.append", KV_PAGES,
      note="a preempted request's blocks delivered again when it starts over"),
    m("prefix cache", BAT, "            self.pages.register_prefix(index, row.prompt[:aligned])", "            pass",
      KV_PAGES, note="a prefilled prompt's pages never offered to the prefix cache"),
    m("prefix cache", "simsd/engine/pages.py", "self.prefix_hit += hit * self.page_size", "self.prefix_hit += 0",
      KV_PAGES, "tests/bench/test_bench_prefix_cache.py", note="prefix cache hits not counted"),
    m("prefix cache", BAT, "if self.pages is not None and self.pages.prefix_caching and offer and row.prompt:",
      "if False:", KV_PAGES,
      note="an ended request's prompt and output pages never offered to the prefix cache"),
    # issue 36: several finishes, prompt lookup, next-block chains (2026-12-05) ---------------------
    m("several finishes", SR, "written = node == verdict.finished[0]", "written = node in verdict.finished", SELF,
      note="a non-first proposed finished block that was the target's treated as written (never committed)"),
    m("several finishes", SR, "if not written:  # the first proposed", "if node not in verdict.finished:  # the first "
      "proposed", SELF, note="the written finished block not rolled back when another finish was the target's"),
    m("several finishes", SR, 'fwd = self.layouts.flush("target")  # the last block', "fwd = None  # the last block",
      SELF, note="a block finished by a lookahead round's chain drops the pending commit of the block before it"),
    m("several finishes", SD, "[(KIND_KNOWN, first[i] + n[i], first[i]) for i in range(m)",
      "[(KIND_KNOWN, first[-1] + n[-1], first[i]) for i in range(m)", SELF, LOGPROBS_MODES,
      note="a next block under a later finish sees the earlier proposed finished blocks too"),
    m("prompt lookup", "simsd/speculative/ngram.py", "self.after[tuple(self.tokens[i - n:i])] = i",
      "self.after.setdefault(tuple(self.tokens[i - n:i]), i)", NGRAM_TESTS,
      note="an n-gram predicts what followed its first occurrence, not its latest"),
    m("prompt lookup", "simsd/speculative/ngram.py",
      "for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):",
      "for n in range(self.min_n, min(self.max_n, len(context)) + 1):", NGRAM_TESTS,
      note="the shortest matching context predicts, not the longest"),
    m("prompt lookup", "simsd/speculative/ngram.py", "before = len(prompt) - first",
      "before = len(prompt)", NGRAM_TESTS, SELF,
      note="the first block's prompt tail indexed before its block is done (in the history and the block)"),
    m("prompt lookup", "simsd/speculative/ngram.py", "self.extend(prompt[len(self.tokens):before])",
      "self.tokens.extend(prompt[len(self.tokens):before])", NGRAM_TESTS,
      note="the prompt's n-grams (its tail's with them, once its block is done) never indexed"),
    m("prompt lookup", "simsd/speculative/ngram.py", "context = [] if t is None else context + [t]",
      "context = [] if t is None else context", NGRAM_TESTS,
      note="a block's predictions made without the predictions before them"),
    m("prompt lookup", "simsd/speculative/tree.py", "new = torch.where(revealed & (fill != mask_id), fill, new)",
      "new = torch.where(fill != mask_id, fill, new)", TREE,
      note="a history alternative fills every predicted MASK position, not the step's"),
    m("prompt lookup", "simsd/speculative/tree.py", "new = torch.where(revealed & (fill != mask_id), fill, new)",
      "new = torch.where(revealed, fill, new)", TREE,
      note="a history alternative puts MASK where the history predicts nothing"),
    m("next-block chain", "simsd/speculative/width.py", "copies, steps = copies + 1, steps - gain",
      "copies, steps = copies, steps - gain", WIDTH, note="the next block's predicted steps not counted in the width"),
    m("next-block chain", "simsd/speculative/width.py", "hit[0] += d <= valid", "hit[0] += d < valid", WIDTH,
      note="the next block's last right predicted step counted as wrong"),
    m("next-block chain", "simsd/speculative/width.py", "while d < available and copies < cap:",
      "while d < available:", WIDTH, NGRAM_TESTS,
      note="a history chain without logits longer than --speculation-width"),
    m("next-block chain", SD, "if any(tokens[i] == M for i in at) or len(at) == state.count(M):",
      "if any(tokens[i] == M for i in at):", NGRAM_TESTS, SELF,
      note="a history chain's step that fills the block proposed (a verify copy of a full block)"),
    m("next-block chain", SD, "indices + [k for c in chains for k in range(c.nodes)]",
      "indices + [0 for c in chains for k in range(c.nodes)]", SELF, LOGPROBS_MODES,
      note="every step of a next-block chain taken as the next block's first (its schedule and noise)"),
    m("next-block chain", SD, "at = (starts + nodes).index_select(0, sel)[0]",
      "at = (starts + nodes - 1).index_select(0, sel)[0]", SELF,
      note="the next block's proposals kept from the copy before its deepest valid one"),
    m("next-block chain", SR, 'self.layouts.start("target"), 0, steps, lp=', 'self.layouts.start("target"), 0, 1, lp=',
      SELF, LOGPROBS_MODES, note="a next block begun by a lookahead round at step 1 whatever chained steps it took"),
    m("next-block chain", SR, "self.stats.accepted += next_acc", "self.stats.accepted += 0", SELF,
      note="the next block's accepted predicted tokens not counted as accepted"),
    m("next-block chain", SR, "self.mark([self.mask_id] * len(host), host, proposed)",
      "self.mark([self.mask_id] * len(host), host, set())", SELF,
      note="the next block's accepted predicted tokens counted as the target's"),
    m("duplicate siblings", SD, "            if key in seen:\n", "            if key is None:\n", TREE, SELF,
      note="a proposed state that repeats a sibling kept (one copy wasted per repeat)"),
    m("duplicate siblings", SD, "        if not known or fill is not None:  # data-dependent counts",
      "        if not known:  # data-dependent counts", TREE, HOST_READS,
      note="a tree holding the history's predictions never read back: its repeated siblings kept"),
]


def parse_only(text: str, n: int) -> list:
    out = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        lo, hi = int(a), int(b or a)
        if not 1 <= lo <= hi <= n:
            raise SystemExit(f"--only: {part!r} is outside 1..{n}")
        out.extend(range(lo, hi + 1))
    return out


def line_of(path: Path, text: str) -> int:
    src = path.read_text()
    return src[:src.index(text)].count("\n") + 1


class Applied:
    """Apply a mutant's edits; restore every file on exit, whatever happens."""

    def __init__(self, mutant: Mutant):
        self.mutant = mutant
        self.saved: dict = {}

    def __enter__(self):
        try:
            for file, old, new in self.mutant.edits:
                path = ROOT / file
                self.saved.setdefault(path, path.read_text())
                cur = path.read_text()
                count = cur.count(old)
                if count != 1:
                    raise ValueError(f"{file}: the text to mutate occurs {count} times: {old!r}")
                path.write_text(cur.replace(old, new))
        except BaseException:
            self.restore()
            raise
        return self

    def restore(self):
        for path, src in self.saved.items():
            path.write_text(src)

    def __exit__(self, *exc):
        self.restore()
        return False


def run_tests(tests, timeout: float) -> tuple[str, float, str]:
    per_test = max(10, int(min(timeout, 120)))  # pytest-timeout: a hanging test fails on its own
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", f"timeout={per_test}", *tests]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return "killed (timeout)", time.perf_counter() - t0, ""
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    secs = time.perf_counter() - t0
    last = out.strip().splitlines()[-1] if out.strip() else ""
    if proc.returncode == 0:
        return "survived", secs, last
    if proc.returncode in (1, 2):
        return "killed", secs, last
    return f"error (pytest exit {proc.returncode})", secs, out[-2000:]


def applies(mu: Mutant) -> bool:
    """Every edit's text occurs exactly once (otherwise the code moved on: the mutant is stale)."""
    return all((ROOT / file).is_file() and (ROOT / file).read_text().count(old) == 1 for file, old, _ in mu.edits)


def where(mu: Mutant) -> str:
    file, old, _ = mu.edits[0]
    line = line_of(ROOT / file, old) if applies(mu) else "?"
    return f"{file}:{line}" + (f" (+{len(mu.edits) - 1} mirrors)" if len(mu.edits) > 1 else "")


def describe(i: int, mu: Mutant) -> str:
    stale = "" if applies(mu) else "  [stale: the text to mutate is gone]"
    return f"{i:3d}  {mu.kind:24s} {where(mu):48s} {mu.note}{stale}"


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    signal.signal(signal.SIGTERM, _interrupt)  # a killed runner restores the files too
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--only", help="mutant numbers to run, e.g. 3,7-9 (1-based, as --list shows)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant before it counts as a hang")
    ap.add_argument("--no-baseline", action="store_true", help="skip the run without mutants")
    ap.add_argument("--markdown", help="also write the result table to this Markdown file")
    args = ap.parse_args(argv)
    chosen = parse_only(args.only, len(MUTANTS)) if args.only else list(range(1, len(MUTANTS) + 1))
    if args.list:
        for i in chosen:
            print(describe(i, MUTANTS[i - 1]))
        return 0
    stale = [i for i in chosen if not applies(MUTANTS[i - 1])]
    for i in stale:
        print(f"mutant {i} is stale (its text is not in the code once): {MUTANTS[i - 1].edits}", file=sys.stderr)
    chosen = [i for i in chosen if i not in stale]
    if not args.no_baseline:
        tests = sorted({t for i in chosen for t in MUTANTS[i - 1].tests})
        status, secs, last = run_tests(tests, args.timeout * 3)
        print(f"baseline ({len(tests)} test files): {'green' if status == 'survived' else status} in {secs:.0f} s"
              f" {last}", flush=True)
        if status != "survived":
            return 1
    rows = []
    try:
        for i in chosen:
            mu = MUTANTS[i - 1]
            with Applied(mu):
                status, secs, last = run_tests(mu.tests, args.timeout)
            rows.append((i, mu, status, secs))
            print(f"{describe(i, mu)}\n     -> {status} ({secs:.0f} s) {last if status != 'survived' else ''}",
                  flush=True)
    except KeyboardInterrupt:
        print("interrupted: files restored", file=sys.stderr)
        return 130
    killed = sum(r[2].startswith("killed") for r in rows)
    survived = [r for r in rows if r[2] == "survived"]
    errors = [r for r in rows if r[2].startswith("error")]
    total = (f"{killed} killed, {len(survived)} survived, {len(errors)} errors, of {len(rows)} mutants"
             + (f" ({len(stale)} stale, not run)" if stale else ""))
    print(f"\n{total}")
    if args.markdown:
        lines = ["| # | kind | where | mutant | result | s |", "|---|---|---|---|---|---|"]
        for i, mu, status, secs in rows:
            lines.append(f"| {i} | {mu.kind} | `{where(mu)}` | {mu.note} | {status} | {secs:.0f} |")
        lines.append(f"\n{total}")
        Path(args.markdown).write_text("\n".join(lines) + "\n")
    return 0 if not survived and not errors and not stale else 1


if __name__ == "__main__":
    sys.exit(main())
