"""Entry points: how users reach simsd.

Holds the settings, each declared once (``settings``: the engine's :class:`EngineArgs`, a
request's :class:`SamplingParams`, :func:`resolve`), the Python API (``api``: :class:`LLM` over
the continuous-batching scheduler; ``outputs``: request handles and outputs; ``encoding``:
prompts as token ids, the chat template and its role-marker stops; ``detokenize``: streamed
text that never splits a character, stop strings), the OpenAI-compatible HTTP server (the
``openai`` package: the app, its router, errors and middleware, ``protocol``: request bodies
generated from :class:`SamplingParams`, ``metrics``; ``simsd serve`` in ``serve``), and the
``simsd`` command line over the API (``cli``: options generated from the settings, their
checks, tensor-parallel launch, one-line errors; ``commands``: the ``generate`` command and the
pieces ``bench`` shares with it; ``bench``; ``resources``: the memory a run needs), prompt
sources (``prompts``: bundled held-out prompts, CHAMP, HumanEval, JSONL files and stdin) and
the error and warning types (``errors``).

May import every other room of simsd. Nothing of simsd imports this room (``simsd/__init__.py``
re-exports the API).
"""
