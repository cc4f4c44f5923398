"""specd's one error hierarchy: every failure a user can cause or fix is a `SpecdError` of one kind.

Contract: code raises the most specific kind it knows; the edges translate, in one place each:
the CLI prints `specd: error: <message>` and exits 2, the HTTP layers answer `as_json()` (OpenAI's
error shape) with the kind's `http_status`. Anything that is not a `SpecdError` is a bug and is reported as one.
  BadRequest          input a client or operator sent that cannot be served (400)
    RequestRefused      a generation request the engine will not serve
    RecordRefused       a trajectory record or report that fails validation
    TrafficError        a traffic file that cannot be read
  BadWeights          a checkpoint or drafter version that does not fit (422)
    CheckpointError     a checkpoint folder or drafter file that cannot be loaded
  StoreError          an operation the weight store refuses (409; 404 for what does not exist)
    VersionNotFound     a version number the store does not hold
  TransportError      a peer (broker, learner, HTTP endpoint) that cannot be reached or answered badly (502)
  ConfigurationError  settings that cannot work: a bad broker URL, a missing optional dependency (400)
  SpoolFull           the learner's spool has no disk left (507; `learner/spool.py`)
  InternalError       what a bug answers a client in JSON (500), its traceback in the log
The subclasses of ValueError keep working where callers catch ValueError.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class SpecdError(Exception):
    """Base of every error specd reports to a person; `kind` names it in JSON answers."""

    kind = "specd_error"
    http_status = 500
    param: str | None = None   # the request field at fault, when there is one
    code: str | None = None

    def as_json(self) -> dict[str, Any]:
        """The answer body an HTTP layer sends with `http_status`."""
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


class InternalError(SpecdError):
    """A bug met while answering: the client gets this in JSON, the server's log the traceback."""

    kind = "internal_error"

    def __init__(self, message: str = "internal error (see the server's log)") -> None:
        super().__init__(message)


class BadRequest(SpecdError, ValueError):
    kind = "invalid_request_error"
    http_status = 400


class RequestRefused(BadRequest):
    """A request the engine will not serve, with the reason in words a client can act on (and the
    request field at fault, or OpenAI's error code, where there is one)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class RefusalReason(StrEnum):
    """Why a record or report was refused: the label a learner counts its refusals under."""

    NOT_AN_OBJECT = "not-an-object"
    SCHEMA = "schema"
    TOKENS = "tokens"          # token id lists: not lists, too long, out of the vocabulary, empty
    STEPS = "steps"
    FEATURES = "features"
    MALFORMED = "malformed"    # a missing or mistyped field
    REPORT = "report"          # an acceptance report
    TOO_SHORT = "too-short"    # valid, but shorter than the learner's objective can use


class RecordRefused(BadRequest):
    """A record (or acceptance report) that fails validation; the message says which field and why,
    `reason` which kind of fault it is."""

    def __init__(self, message: str, reason: RefusalReason = RefusalReason.MALFORMED) -> None:
        super().__init__(message)
        self.reason = reason


class TrafficError(BadRequest):
    """Traffic that cannot be read, with the file and line."""


class BadWeights(SpecdError, ValueError):
    kind = "bad_weights"
    http_status = 422


class CheckpointError(BadWeights):
    """A checkpoint folder or drafter file that cannot be loaded, with the reason."""


class StoreError(SpecdError, ValueError):
    """An operation the weight store refuses, with the reason."""

    kind = "store_error"
    http_status = 409


class VersionNotFound(StoreError):
    http_status = 404


class TransportError(SpecdError):
    kind = "transport_error"
    http_status = 502


class ConfigurationError(SpecdError, ValueError):
    kind = "configuration_error"
    http_status = 400


_OUT_OF_SPACE_TEXT = ("No space left on device", "os error 28", "database or disk is full", "Disk quota exceeded")


def out_of_space(error: BaseException) -> bool:
    """Whether `error` (or what it was raised from) is a full disk: an OSError with ENOSPC or
    EDQUOT, or the same from libraries that wrap it in their own exception (safetensors' writer,
    SQLite), which only their text says."""
    import errno

    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(seen) for text in _OUT_OF_SPACE_TEXT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
