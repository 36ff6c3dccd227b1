"""Entry points: how users reach simsd.

Holds the Python API (``api``: :class:`LLM` over the continuous-batching scheduler, request
handles and outputs; ``params``: a request's :class:`SamplingParams` and their checks;
``detokenize``: streamed text that never splits a character, stop strings), the
OpenAI-compatible HTTP server (``server``, ``protocol``, ``metrics``; ``simsd serve`` in
``serve``), the ``simsd`` command line (``cli``: the parser, tensor-parallel launch, one-line
errors), the ``generate`` command and the pieces ``bench`` shares with it (``commands``),
``simsd bench`` (``bench``), prompt sources (``prompts``: bundled held-out prompts, CHAMP,
HumanEval, JSONL files and stdin) and the command-line error type (``errors``).

May import every other room of simsd. Nothing of simsd imports this room (``simsd/__init__.py``
re-exports the API).
"""
