"""Entry points: how users reach simsd.

Holds the ``simsd`` command line (``cli``: the parser, tensor-parallel launch, one-line
errors), the ``generate`` command and the pieces ``bench`` shares with it (``commands``),
``simsd bench`` (``bench``), prompt sources (``prompts``: bundled held-out prompts, CHAMP,
HumanEval, JSONL files and stdin) and the command-line error type (``errors``).

May import every other room of simsd. Nothing of simsd imports this room.
"""
