"""Domain errors of the use cases. They say what went wrong in the service's own words; only the HTTP
layer (:mod:`api.http.problems`) turns them into RFC 9457 problems, and the CLI prints them as they are
(each is a :class:`FoldtuneError`, so ``foldtune`` reports it as one ``error:`` line)."""

from __future__ import annotations

from spec.errors import FoldtuneError


class ServiceError(FoldtuneError):
    """A use case refused a request. ``kind`` is a short slug naming the case, ``title`` a few words,
    ``detail`` the sentence a user reads (also ``str(error)``)."""

    def __init__(self, kind: str, title: str, detail: str) -> None:
        super().__init__(detail)
        self.kind, self.title, self.detail = kind, title, detail


class NotFound(ServiceError):
    """The thing asked for does not exist (or belongs to another owner, which reads the same)."""

    def __init__(self, detail: str, *, kind: str = "not-found", title: str = "Not found") -> None:
        super().__init__(kind, title, detail)


def not_found(what: str) -> NotFound:
    """NotFound for ``what`` ("job 3", "training 7", ...)."""
    return NotFound(f"{what} does not exist")


class Conflict(ServiceError):
    """The request contradicts the stored state (a finished job, a name taken, a reused idempotency key)."""


class RuleViolation(ServiceError):
    """The request breaks one named rule found after schema validation: ``loc`` is where (``body.model``,
    ``query``), ``rule`` its name (``known_model``), ``message`` why."""

    def __init__(self, loc: str, rule: str, message: str) -> None:
        super().__init__("validation", "Request breaks a validation rule", f"{loc}: {message} [{rule}]")
        self.loc, self.rule, self.message = loc, rule, message


class Unavailable(ServiceError):
    """The service cannot do this work now (every planning slot busy, or the planning ran past its time
    limit); ``retry_after`` is the seconds a client should wait before asking again."""

    def __init__(self, kind: str, title: str, detail: str, retry_after: int) -> None:
        super().__init__(kind, title, detail)
        self.retry_after = retry_after
