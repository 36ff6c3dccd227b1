"""Entry points: how users reach simsd.

Holds the Python API (``api``: :class:`LLM` over the continuous-batching scheduler;
``outputs``: request handles and outputs; ``params``: a request's :class:`SamplingParams` and
their checks; ``encoding``: prompts as token ids, the chat template and its role-marker stops;
``detokenize``: streamed text that never splits a character, stop strings), the
OpenAI-compatible HTTP server (``server``, ``protocol``, ``metrics``; ``simsd serve`` in
``serve``), and the ``simsd`` command line over the API (``cli``: the parser, tensor-parallel
launch, one-line errors; ``options``: option checks shared with the API; ``commands``: the
``generate`` command and the pieces ``bench`` shares with it; ``bench``; ``resources``: the
memory a run needs), prompt sources (``prompts``: bundled held-out prompts, CHAMP,
HumanEval, JSONL files and stdin) and the error and warning types (``errors``).

May import every other room of simsd. Nothing of simsd imports this room (``simsd/__init__.py``
re-exports the API).
"""
