"""Errors a user can act on. The CLI prints them as one paragraph, never a traceback."""

from __future__ import annotations


class LlmctlError(Exception):
    """Base class: the message names what is wrong and how to fix it."""


class OptionError(LlmctlError):
    """An option value is missing, malformed, out of range or refused by a backend."""


class ProfileError(LlmctlError):
    """A profile file cannot be read, or a profile is missing or invalid."""


class BackendError(LlmctlError):
    """No backend can serve the request, or the one asked for cannot."""


class ModelError(LlmctlError):
    """The model argument does not name a usable model."""


class InvalidRequest(LlmctlError, ValueError):
    """A generation request the engine refuses before starting (too long, bad params).

    The server answers it with HTTP 400; engines raise it from ``generate`` before
    yielding anything. ``param`` names the request field at fault (the server reports
    it as OpenAI's ``param``); ``code`` is a machine-readable reason, such as
    ``context_length_exceeded``.
    """

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class EngineError(LlmctlError, RuntimeError):
    """The engine failed while running a request (a fault in the model call, or an
    engine that has stopped). Not the client's fault: the server answers HTTP 500."""


class EngineDead(EngineError):
    """The engine cannot run any more (a tensor-parallel rank died or hung): requests in
    flight fail, new ones are refused. The server answers 503 and ``serve`` exits non-zero."""


class UpstreamError(LlmctlError):
    """A remote server an engine forwards to is unreachable, failed (5xx) or refused us.

    Raised by proxy backends (e.g. ``openai-proxy``); the server answers it with HTTP 502
    in OpenAI's error shape, since the fault is neither the client's nor this server's.
    """
