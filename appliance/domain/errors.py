"""The one root of every error the appliance reports to a person or a client."""

from __future__ import annotations


class ApplianceError(Exception):
    """A known failure with a stable code, the HTTP status it maps to and a one-line message.

    The API renders it as OpenAI-style error JSON; the CLI prints `message` alone and exits
    with `exit_code`. Anything that is not an ApplianceError is a bug and keeps its traceback.
    """

    code: str = "appliance_error"
    http_status: int = 500
    exit_code: int = 1

    def __init__(self, message: str, *, code: str | None = None, http_status: int | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if http_status is not None:
            self.http_status = http_status


class PromptOverflow(ApplianceError):
    """A turn refused because its prompt alone leaves the model's window no room for an
    answer: its harness must compact its context, so the session's KV past the system prompt
    and tools will not be used again (the idle reaper drops it)."""


class ConfigError(ApplianceError):
    """The configuration names an unknown key or a bad value; the message names the fix."""

    code = "config_error"
    http_status = 400
    exit_code = 2


class LedgerError(ApplianceError):
    """The ledger file cannot be used as it is (not SQLite, newer schema, unwritable)."""

    code = "ledger_error"
    http_status = 500
    exit_code = 2


class LedgerUnavailable(LedgerError):
    """The ledger cannot write now (a full disk, an I/O error): the appliance takes no new
    work until it can, so nothing is answered without its record. Retry later."""

    code = "ledger_unavailable"
    http_status = 503
    retry_after_s = 5.0


class DataDirError(ApplianceError):
    """The data directory cannot be created or written."""

    code = "data_dir_error"
    http_status = 500
    exit_code = 2


class EngineError(ApplianceError):
    """Something about the inference engines; the subclasses say what."""

    code = "engine_error"
    http_status = 503
    exit_code = 1


class EngineUnavailable(EngineError):
    """A worker could not be reached (connection refused, timeout, dead engine)."""

    code = "engine_unavailable"
    http_status = 503


class EngineTimedOut(EngineUnavailable):
    """A worker took a model request and sent nothing for `engine.request_timeout_s`: the
    request is closed there and the turn answered 504, never retried elsewhere (a request
    that hangs one worker would likely hang the next, and the client has waited already)."""

    code = "worker_timeout"
    http_status = 504


class EngineRequestError(EngineError):
    """A worker answered with an error status; `http_status` and `body` are its own."""

    code = "engine_request_error"

    def __init__(self, message: str, *, http_status: int, body: str = "") -> None:
        super().__init__(message, http_status=http_status)
        self.body = body
