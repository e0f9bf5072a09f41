"""``llmctl chat``: a terminal chat with an in-process engine or a remote server.

Three layers, top to bottom:

- ``terminal``: the front ends, ``run_interactive`` and ``run_piped``: read lines, stream
  answers to stdout, turn Ctrl-C into "stop this answer";
- ``session``: ``ChatSession``, the conversation, sampling settings and slash commands;
- a ``Connection`` (``connection``): ``LocalConnection`` drives an in-process ``Engine``,
  ``RemoteConnection`` (``remote``) any OpenAI-compatible server over HTTP with SSE.

A model without a chat template runs in continuation mode: the line typed is a plain
prompt and the answer is its continuation; earlier turns are not sent.
"""
