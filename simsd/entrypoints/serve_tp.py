"""``simsd serve --tp N``: rank 0 runs the HTTP server and leads the rounds, the other ranks
follow them (:mod:`simsd.engine.tp_rounds`; the ranks are launched as for ``simsd generate --tp``:
:func:`simsd.entrypoints.cli.launch_tp`)."""
from __future__ import annotations

from functools import partial


def rank_of() -> int:
    """This process's tensor-parallel rank (0 without a group)."""
    from ..engine.tp import world
    return world()[0]


def lead(llm):
    """Make ``llm`` (rank 0's) lead the other ranks' rounds: its :class:`~simsd.engine.tp_rounds.Leader`,
    None with one rank (nothing changes)."""
    if llm.tp == 1:
        return None
    from ..engine.tp_rounds import Leader, control_group
    leader = Leader(control_group())
    llm.lead(leader.publish)
    return leader


def run_follower(llm) -> int:
    """A rank > 0: with ``llm``, the same LLM as rank 0's (``simsd serve``'s options), run rank
    0's rounds until it stops (:func:`~simsd.engine.tp_rounds.follow`). No HTTP server."""
    from ..engine.tp_rounds import control_group, follow
    follow(llm.scheduler, partial(llm.requests.rebuild, llm), control_group())
    return 0
