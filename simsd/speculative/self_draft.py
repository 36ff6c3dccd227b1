"""Self-speculation: the target proposes its own next steps (``draft="self"``; docs/design.md §4.4).

No draft model. Every exact verify forward of a row carries its state and a chain of proposed
states; the target's step on each copy is computed there anyway (:class:`~simsd.speculative.verifiers.ExactVerifier`),
and its logits are kept (``Step(keep_logits=True)``). After the verdict the logits of the last
*valid* copy -- the copy whose step produced the new block -- are the freshest the target has
of this block, one step old: :class:`SelfDraft` proposes the next round's chain from them, each
proposed step drawn as the strategy would draw that step (its schedule entry, its keyed noise:
:func:`simsd.decoding.step.denoise_step` on the same logits, step after step). Exact
verification then accepts a proposed step only if it is the target's own decision at that
state, so the output is vanilla decoding's whatever the proposals (the SimSD paper's
self-speculative setting, where reference tokens come from "previously decoded trajectories").

A block's first round has nothing to propose from (the chain is empty: one copy, a plain target
step); from its second round on each forward decides its own step plus every proposed step
that was right.
"""
from __future__ import annotations

import time

import torch

from simsd_kernels import KIND_KNOWN, TAU_INF

from ..decoding.layouts import exact_layout
from ..decoding.noise import NoiseKey, step_noise
from ..decoding.sampling import filtered_probs
from ..decoding.step import Step
from ..engine.host_sync import to_device
from .ngram import NgramIndex
from .tree import ProposalTree, masks_after, step_candidates, step_draws
from .verification import tree_verdict
from .verifiers import ExactVerifier, PaperVerifier, Verdict
from .width import TreePlan, WidthPolicy


class SelfDraft:
    """One row's proposals from the target's own logits (module doc).

    Args:
        cfg: the target's decoding settings (the proposals follow its strategy and schedule).
        mask_id: the MASK token id.
        gamma: the most steps a round proposes (the tree's depth).
        width: ``speculation_width``, ``"auto"`` or the most block copies of a verify forward:
            each round's tree (candidates of each node's step, the primary and its alternatives,
            :func:`~simsd.speculative.tree.step_candidates`) is grown best first by
            :class:`~simsd.speculative.width.WidthPolicy` (:meth:`~simsd.speculative.width.WidthPolicy.plan`).
        alternatives: a fixed shape instead (a spine of ``gamma`` primaries, this many
            alternatives beside each, :meth:`fixed_plan`), for tests.

    ``logits``: ``(L, V)`` the kept logits (MASK made impossible), on the target's device, or
    None (a fresh block); set by :meth:`keep`, used up by :meth:`propose`. ``upcoming``: ``(L,
    V)`` the logits of the next block's first step under a finished block a lookahead proposed
    and the target did not take (a block one token away, most often: its predictions of the
    next block are proposals like any other), for the next block's first round. ``policy``: the
    :class:`~simsd.speculative.width.WidthPolicy` (its ``cost`` set by the row: the engine's).
    ``ngram``: the row's :class:`~simsd.speculative.ngram.NgramIndex` (its history, fed by the row),
    whose predictions are proposed beside the logits' (the ``NGRAM`` kinds of
    :data:`~simsd.config.speculative.ALTERNATIVES`).
    """

    def __init__(self, cfg, mask_id: int, gamma: int, width="auto", alternatives: int | None = None):
        self.cfg, self.mask_id, self.gamma, self.alternatives = cfg, mask_id, gamma, alternatives
        self.policy = WidthPolicy(width, gamma, cfg.block_length)
        self.logits: torch.Tensor | None = None
        self.upcoming: torch.Tensor | None = None
        self.ngram = NgramIndex()
        self.reads = 0  # host reads of grown trees (:meth:`_prune`)

    def keep(self, logits: torch.Tensor, copy: torch.Tensor) -> None:
        """Keep the logits of one verify copy: ``logits (C, L, V)`` of a verify forward's copies,
        ``copy`` a 0-d int64 device tensor (the copy whose step gave the new block); no host read."""
        self.logits = logits.index_select(0, copy.view(1))[0]

    def new_block(self, begun: bool) -> None:
        """A new block starts: ``begun`` by a lookahead (its logits kept by the round), or not:
        then its first proposals come from :attr:`upcoming` if a round of the last block computed
        it, never from the last block's own logits."""
        if not begun:
            self.logits = self.upcoming
        self.upcoming = None

    def propose(self, block: torch.Tensor, block_step: int, masks: int, key: NoiseKey,
                lookahead: bool = False, host: list | None = None) -> ProposalTree:
        """The proposal tree of the round starting at ``block (L,)`` after ``block_step`` steps
        with ``masks`` MASK left: up to ``gamma`` steps deep (a node at depth ``d`` is step
        ``block_step + d`` applied to its parent's state from the kept logits with that step's
        noise; ``key``: the row's block key), each node one candidate of its parent's step
        (:func:`~simsd.speculative.tree.step_candidates`), the tree grown best first by
        :attr:`policy` (``lookahead``: a node that finishes the block may also carry the next
        block's first step, two more copies). Without kept logits the tree is a chain of the
        history's next steps (:meth:`history_chain`), or the block alone.
        The ``dynamic`` and ``entropy`` strategies reveal data-dependent counts, and a history's
        token may be the logits' one (two siblings the same state): then the nodes' states are
        read in one host read after the tree is grown (:attr:`reads` counts them), and nodes that
        reveal nothing, hang below a full state or repeat a sibling are dropped
        (:meth:`_prune`). ``host``: the block on the host, for the history's
        predictions (:attr:`ngram`, fed by the row: :meth:`~simsd.speculative.ngram.NgramIndex.follow`;
        None: none)."""
        logits, self.logits = self.logits, None
        predicted = None if host is None or masks == 0 else self.ngram.fill(host, self.mask_id)
        if logits is None and predicted is not None:  # nothing to propose from but the history
            chain = self.history_chain(host, predicted, block_step)
            chain = chain[:1 + self.policy.chain_length(len(chain) - 1, self.policy.rows())]
            if len(chain) > 1:
                return ProposalTree(to_device(chain, block.device), [-1] + list(range(len(chain) - 1)),
                                    list(range(len(chain))), [True] * len(chain), masks - chain[-1].count(self.mask_id),
                                    None, masks=masks)
        if logits is None or masks == 0:
            return ProposalTree(block[None], [-1], [0], [masks > 0], 0, [0], masks=masks)
        per_step = self.per_step(block_step)
        fill = None if predicted is None or predicted == host else to_device(predicted, block.device)
        chain = self.ahead_chain(predicted) if lookahead and predicted is not None else []
        if self.alternatives is None:
            plan = self.policy.plan(masks, per_step, self.cfg.strategy in ("static", "dynamic"), self.policy.rows(),
                                    lookahead, fill is not None, len(chain) - 1 if chain else 0)
        else:
            plan = self.fixed_plan(masks, per_step)
        started = time.perf_counter()
        tree = self._grow(logits, block, block_step, masks, key, plan, per_step, fill, chain)
        self.policy.proposing(time.perf_counter() - started, tree.nodes - 1)
        return tree

    def ahead_chain(self, predicted: list) -> list:
        """The next block's first steps as the row's history predicts them (:meth:`history_chain`
        from the next block all MASK, the history's tokens after the finished block
        ``predicted``: the round's block with the history's predictions)."""
        M = [self.mask_id] * self.cfg.block_length
        return self.history_chain(M, self.ngram.fill(M, self.mask_id, before=predicted), 0)

    def history_chain(self, state: list, tokens: list, block_step: int) -> list:
        """Host lists: ``state`` (a block after ``block_step`` steps), then after each next step the
        schedule's count of its leftmost MASK positions given ``tokens`` (the history's
        predictions, :meth:`~simsd.speculative.ngram.NgramIndex.fill`), while they are predicted
        and MASK is left after them (a step that fills the block saves nothing: the target's
        step before it fills it)."""
        M = self.mask_id
        chain = [state]
        for reveals in self.per_step(block_step):
            at = [i for i, t in enumerate(state) if t == M][:max(1, reveals)]
            if any(tokens[i] == M for i in at) or len(at) == state.count(M):
                break
            state = [tokens[i] if i in at else t for i, t in enumerate(state)]
            chain.append(state)
        return chain

    def fixed_plan(self, masks: int, per_step: list) -> TreePlan:
        """The tree of a fixed ``alternatives`` (tests): a spine of ``gamma`` primary steps, each
        with its first ``alternatives`` candidates beside it, while MASK is left."""
        plan, spine, left = TreePlan([-1], [0], [0]), 0, masks
        for d in range(1, self.gamma + 1):
            if left == 0:
                break
            first = len(plan.parent)
            for k in range(1 + self.alternatives):
                plan.parent.append(spine)
                plan.kind.append(k)
                plan.depth.append(d)
            spine, left = first, masks_after(left, per_step[d - 1])
        return plan

    def chain(self, block: torch.Tensor, block_step: int, masks: int, key: NoiseKey, draft_type, with_probs: bool):
        """Paper mode's proposal: a chain of up to ``gamma`` steps from the kept logits (the
        paper's layout verifies one chain) as a ``draft_type`` (:class:`~simsd.speculative.spec_row.Draft`:
        the states before each step, the final state, the reveal steps and, for rejection
        sampling (``with_probs``), the distribution each token was drawn from: the kept logits'
        filtered one), or None without kept logits (the row takes a target step first)."""
        logits, self.logits = self.logits, None
        if logits is None or masks == 0:
            return None
        per_step = self.per_step(block_step)
        depth, left = 0, masks
        while depth < self.gamma and left > 0:  # the steps that leave MASK to reveal
            left = masks_after(left, per_step[depth])
            depth += 1
        known = self.cfg.strategy in ("sequential", "static")
        tree = self._grow(logits, block, block_step, masks, key, TreePlan.chain(depth if known else self.gamma),
                          per_step)
        states = list(tree.states.unbind(0))
        tau = torch.full_like(block, TAU_INF)
        for c in range(1, len(states)):
            tau.masked_fill_(states[c] != states[c - 1], c)
        probs = filtered_probs(logits, self.cfg.sampling) if with_probs else None
        return draft_type(states[:-1], states[-1], tau, probs, masks - tree.proposed, states[-1])

    def per_step(self, block_step: int) -> list:
        """Tokens each of the next ``gamma`` steps reveals (the schedule's; 1 where the strategy's
        counts depend on the data)."""
        known = self.cfg.strategy in ("sequential", "static")
        return [self.cfg.tokens_for_step(block_step + d) if known else 1 for d in range(self.gamma)]

    def _grow(self, logits, block, block_step: int, masks: int, key: NoiseKey, plan: TreePlan,
              per_step: list, fill: torch.Tensor | None = None, chain=()) -> ProposalTree:
        """The tree of ``plan``: each node's state is its kind's candidate of its parent's step
        (the candidates of one parent drawn together, each step's draws once; ``fill (L,)``: the
        history's predictions, or None; ``chain``: :meth:`ahead_chain`, the next block's states
        proposed under the finishes)."""
        cfg = self.cfg
        known = cfg.strategy in ("sequential", "static")
        states, parent, depths, left, kind = [block], [-1], [0], [masks], [0]
        at = {0: 0}  # plan node -> tree node
        draws, children = {}, {}
        for j in range(1, len(plan.parent)):
            p, d = plan.parent[j], plan.depth[j]
            if p not in at:
                continue  # its parent's kind did not apply
            if p not in children:
                index = block_step + d - 1
                if d not in draws:
                    noise = None if cfg.sampling.greedy else step_noise([key], [index], block.shape[0],
                                                                        logits.shape[-1], logits.device)[0]
                    draws[d] = (noise, step_draws(logits, self.mask_id, cfg, noise))
                noise, drawn = draws[d]
                wanted = [plan.kind[c] for c in range(j, len(plan.parent)) if plan.parent[c] == p]
                cands, kinds = step_candidates(logits, states[at[p]], self.mask_id, cfg, index, noise, wanted,
                                               left[at[p]] if known else None, draws=drawn, fill=fill)
                children[p] = dict(zip(kinds, cands))
            state = children[p].get(plan.kind[j])
            if state is None:
                continue
            at[j] = len(states)
            states.append(state)
            parent.append(at[p])
            depths.append(d)
            left.append(masks_after(left[at[p]], per_step[d - 1]) if known else None)
            kind.append(plan.kind[j])
        planned = dict(zip(plan.finishes, plan.ahead))  # the next block's steps under each finish
        ahead = {at[f]: planned[f] for f in plan.finishes if f in at}
        finishes = list(ahead)
        if not known or fill is not None:  # data-dependent counts, or siblings that may be equal
            states, parent, depths, left, kind, kept = self._prune(states, parent, depths, kind, finishes)
            self.reads += 1
            moved = {}
            for f, k in zip(finishes, kept):
                if k is not None and k not in moved:  # a finish equal to an earlier one is that one
                    moved[k] = ahead[f]
            ahead, finishes = moved, list(moved)
        finishes = [f for f in finishes if left[f] == 0]
        proposed = sum(left[parent[j]] - left[j] for j in range(1, len(states)))
        steps = [ahead[f] for f in finishes]
        proposed += sum(len(chain[d]) - chain[d].count(self.mask_id) for d in steps)  # the next block's
        return ProposalTree(torch.stack(states), parent, depths, [m > 0 for m in left], proposed, kind,
                            tuple(finishes), masks, tuple(steps), chain[:1 + max(steps, default=0)])

    def _prune(self, states: list, parent: list, depth: list, kind: list, finishes: list) -> tuple:
        """From one host read of the nodes' states: the nodes whose step revealed something, whose
        parent had MASK and whose state no earlier sibling has (a history's token may be the
        logits' one: the same state twice is one copy wasted; the later one is dropped and its
        children go to the earlier), renumbered, parents kept before children. Returns the kept
        ``(states, parent, depth, MASK left, kind)`` and each of ``finishes``' new index (None:
        dropped)."""
        host = torch.stack(states).tolist()
        left = [row.count(self.mask_id) for row in host]
        keep, new_index, seen = [0], {0: 0}, {}
        for j in range(1, len(states)):
            p = parent[j]
            if p not in new_index or left[p] == 0 or left[j] >= left[p]:
                continue
            key = (new_index[p], tuple(host[j]))
            if key in seen:
                new_index[j] = seen[key]  # the same state as an earlier sibling: that node
                continue
            new_index[j] = seen[key] = len(keep)
            keep.append(j)
        return ([states[j] for j in keep], [-1] + [new_index[parent[j]] for j in keep[1:]],
                [depth[j] for j in keep], [left[j] for j in keep], [kind[j] for j in keep],
                [new_index.get(f) for f in finishes])

    def observe(self, tree: ProposalTree, node: int) -> None:
        """Count a round's outcome for the width policy: ``node`` the deepest valid node of
        ``tree`` (read with the decision)."""
        if tree.kind is None:  # a chain of the history's steps (:meth:`history_chain`)
            self.policy.observe_ahead(tree.nodes - 1, tree.depth[node])
            return
        valid, j = [], node
        while j >= 0:
            valid.append(j)
            j = tree.parent[j]
        self.policy.observe(tree.masks, tree.parent, tree.depth, tree.kind, valid)


class SelfExactVerifier(ExactVerifier):
    """Exact verification that keeps the target's logits for the row's next proposals: the
    verify step returns its copies' logits, and the deepest valid node's copy's go to
    :attr:`draft`, which proposes up to ``spec.gamma`` (default: the block length) steps.

    **Lookahead** (``rnd.lookahead``: the next block will be decoded): each node of the tree
    chosen to carry one (:attr:`~simsd.speculative.tree.ProposalTree.finishes`, a finished block
    ``F``) comes with two more copies: ``F`` as the block's commit (seeing the cache and itself)
    and the next block, all MASK, at the next positions, seeing the cache, ``F`` (its ancestor in
    the tree mask, as the cache would hold it) and itself: its target step is the next block's
    first step, its logits the next block's first proposals. Its noise is the next block's. The
    first ``F``'s commit copy is written to the cache: when it is the deepest valid node the
    block is finished and committed by this forward; otherwise the row rolls it back
    (:class:`~simsd.speculative.spec_row.SpecRow`), and when another ``F`` is the deepest valid
    node the block is finished, the next block begun, and that ``F`` committed as any finished
    block is (folded into the next forward with ``fold_commit``). Siblings differ, so at most one
    ``F`` is valid.

    Layout: ``[F_0 .. F_m-1 | the tree's copies (C) | N_0 .. N_m-1]`` (``N_i`` the next block under
    ``F_i``; labels: the copies ``grp`` 0..C-1, ``F_i`` ``grp C + 2i`` with ``tau C + 2i + 1``,
    ``N_i`` ``grp C + 2i + 1``: ``N_i`` sees ``F_i`` and no other ``F``, after it in the layout as
    the cache would hold it, so that its keys come in vanilla's order); ``F_0`` written, logits of
    the copies and the ``N_i``."""

    def __init__(self, cfg, spec, mask_id: int, seed: int, alternatives: int | None = None):
        super().__init__(cfg, spec, mask_id, seed)
        self.draft = SelfDraft(cfg, mask_id, spec.gamma or cfg.block_length, spec.speculation_width, alternatives)

    keep_logits = True

    def request(self, layouts, rnd):
        tree = rnd.draft.tree()
        leaves = tree.finishes if rnd.lookahead else ()
        if not leaves:
            return super().request(layouts, rnd)
        shape, copies, indices = self.tree_copies(tree, rnd)
        at = to_device(list(leaves), copies.device)
        every = to_device(tree.ahead_states, copies.device).view(len(tree.ahead_states), -1) \
            if len(tree.ahead_states) > 1 else None
        chains = [self.chain_tree(tree, i, copies, every) for i in range(len(leaves))]
        L, C, m = copies.shape[1], copies.shape[0], len(leaves)
        n = [c.nodes for c in chains]
        # each next block's first copy among the verify copies (the logits' rows), on the device once
        starts = to_device([C + sum(n[:i]) for i in range(m)], copies.device)
        rnd.layout = (tree, shape, (at, chains, starts))
        ids, positions, labels = exact_layout(copies, rnd.start)
        here, after = list(range(rnd.start, rnd.start + L)), list(range(rnd.start + L, rnd.start + 2 * L))
        finished = tree.states.index_select(0, at)
        ahead = torch.cat([c.states for c in chains])
        first = [C + i + sum(n[:i]) for i in range(m)]  # F_i's group; its next block's copies follow
        ids = torch.cat([finished.view(-1), ids, ahead.view(-1)])
        positions = here * m + list(positions) + after * sum(n)
        labels = ([(KIND_KNOWN, first[i] + n[i], first[i]) for i in range(m) for _ in range(L)] + list(labels)
                  + [(KIND_KNOWN, 0, first[i] + 1 + k) for i in range(m) for k in range(n[i]) for _ in range(L)])
        fwd = layouts.exact("target", ids, positions, labels, write=L, hidden=(m - 1) * L)
        history = None  # a next block's copy counts its proposed finished block as output
        if rnd.history is not None:
            after_finish = [rnd.history.after(tree.states[f]) for f in leaves]
            history = [rnd.history] * C + [after_finish[i] for i in range(m) for _ in range(n[i])]
        fwd.step = Step(torch.cat([copies, ahead]), indices + [k for c in chains for k in range(c.nodes)], self.cfg,
                        self.mask_id, [self.key(rnd.start)] * C + [self.key(rnd.start + L)] * sum(n), keep_logits=True,
                        history=history)
        return fwd

    def chain_tree(self, tree: ProposalTree, i: int, like: torch.Tensor, every) -> ProposalTree:
        """The next block's tree under finish ``i`` of ``tree``: all MASK, then the
        ``tree.ahead[i]`` steps the history predicts, a chain of copies (``like``: a tensor of the
        states' dtype and device; ``every``: ``tree.ahead_states`` there, or None)."""
        d = tree.ahead[i] if tree.ahead else 0
        if d == 0:
            states = torch.full((1, like.shape[-1]), self.mask_id, dtype=like.dtype, device=like.device)
        else:
            states = every[:1 + d]
        return ProposalTree(states, [-1] + list(range(d)), list(range(d + 1)), [True] * (d + 1), 0)

    def judge(self, rnd, out):
        tree, shape, lookahead = rnd.layout
        mine, logits = out[0], out[3].view(-1, *out[3].shape[-2:])
        C = shape[0].shape[0]
        new, taken, accepted, node, valid = tree_verdict(mine[:C], tree.states, shape)
        copy = shape[4].index_select(0, node.view(1))[0]  # the valid node's copy (a finished one has none)
        lp = self.revealing_logits(logits[:C], tree, shape, node)
        if lookahead is None:
            self.draft.keep(logits, copy)
            return Verdict(new, taken, accepted, valid, node, logits=lp)
        leaves, chains, starts = lookahead
        # each finish's next block: the target's step on the deepest valid node of its chain
        nexts, lps, start = [], [], C
        for c in chains:
            cshape = c.constants(new.device)
            nexts.append(tree_verdict(mine[start:start + c.nodes], c.states, cshape)[:4])
            lps.append(self.revealing_logits(logits[start:start + c.nodes], c, cshape, nexts[-1][3]))
            start += c.nodes
        news, takens, accs, nodes = (torch.stack(x) for x in zip(*nexts))
        hit = node == leaves
        sel = hit.long().argmax().view(1)  # the valid finished block (the first if none is)
        at = (starts + nodes).index_select(0, sel)[0]  # its next block's deepest valid copy
        self.draft.keep(logits, torch.where(hit.any(), at, copy))  # finished as proposed: the next block's
        # else, for the next block's first proposals if this block ends without a lookahead: the
        # next block under the proposed finished block nearest the new block (its tokens the most alike)
        near = (tree.states.index_select(0, leaves) != new).sum(-1).argmin().view(1)
        self.draft.upcoming = logits.index_select(0, starts.index_select(0, near))[0]
        return Verdict(new, taken, accepted, valid, node, news.index_select(0, sel)[0], tree.finishes, lp,
                       None if lp is None else torch.stack(lps).index_select(0, sel)[0],
                       takens.index_select(0, sel)[0], accs.index_select(0, sel)[0], nodes.index_select(0, sel)[0])


class SelfPaperVerifier(PaperVerifier):
    """Paper mode with the target's previous predictions as the draft (the SimSD paper's
    self-speculative setting): a round verifies a chain proposed from the kept logits
    (:meth:`SelfDraft.chain`) in the paper's ``[leftover | D | M]`` layout, and keeps its M slots'
    logits (each position's prediction in the round's context) for the next round. A block's
    first round has nothing to propose from: the row takes a target step that keeps its logits
    (:meth:`~simsd.speculative.spec_row.SpecRow.self_step`)."""

    def __init__(self, cfg, spec, mask_id: int, seed: int, alternatives: int | None = None):
        super().__init__(cfg, spec, mask_id, seed)
        self.draft = SelfDraft(cfg, mask_id, spec.gamma or cfg.block_length, spec.speculation_width, 0)

    def judge(self, rnd, logits):
        at = self.slots(rnd, logits)
        verdict = self.accept(rnd, *self.verdicts(rnd, at), at)
        self.draft.logits = at
        return verdict
