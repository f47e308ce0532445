"""``FOLDTUNE_*`` environment settings, read with pydantic-settings: the base of every settings group.

Each group (api.service.paths, api.service.quotas, api.http.settings, api.worker.settings,
api.cli.settings) is a :class:`FoldtuneEnv` subclass whose fields are its variables: field ``port`` is
``FOLDTUNE_PORT`` (a group may change the prefix: ``FOLDTUNE_QUOTA_``). A variable that is unset or empty takes
the field's default. :meth:`FoldtuneEnv.read` reads the process environment or a given mapping (tests, and
callers that resolve settings for someone else) and turns a bad value into one :class:`SpecError` line that
names the variable, the value and what is wrong.

It lives in api/, the only layer that depends on pydantic: db/ reads its two variables (the data directory and
the database URL, ``db/settings.py``) without it, so the migrations need SQLAlchemy alone, and the executor
reads its few switches itself (it runs on GPU hosts with torch alone).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any, ClassVar, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from spec.errors import SpecError

PREFIX = "FOLDTUNE_"
S = TypeVar("S", bound="FoldtuneEnv")

# the mapping FoldtuneEnv.read was given (None: the process environment), seen by settings_customise_sources
_GIVEN: ContextVar[Mapping[str, str] | None] = ContextVar("foldtune_given_environ", default=None)


class _MappingEnvSource(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping instead of ``os.environ`` (as its dotenv
    source does over a file): the same names, prefix, case rule and parsing."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._given = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {(k if self.case_sensitive else k.lower()): v for k, v in self._given.items()
                if not (self.env_ignore_empty and v == "")}


class FoldtuneEnv(BaseSettings):
    """A group of ``FOLDTUNE_*`` variables. ``what`` names the group in errors ("bad service setting ...")."""

    # nan and inf are never a meant setting (a nan limit passes every comparison against it)
    model_config = SettingsConfigDict(env_prefix=PREFIX, env_ignore_empty=True, extra="ignore", frozen=True,
                                      allow_inf_nan=False)
    what: ClassVar[str] = "foldtune"

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        given = _GIVEN.get()
        # explicit values, then the environment; no .env file and no secrets directory: one place to look
        return init_settings, (env_settings if given is None else _MappingEnvSource(settings_cls, given))

    @classmethod
    def read(cls: type[S], environ: Mapping[str, str] | None = None, **values: Any) -> S:
        """The group from ``environ`` (default: the process environment), ``values`` overriding it; SpecError
        ``bad <what> setting in the environment: ...`` naming the first bad variable."""
        token = _GIVEN.set(environ)
        try:
            return cls(**values)
        except ValidationError as exc:
            raise SpecError(f"bad {cls.what} setting in the environment: {cls._problem(exc.errors()[0])}") from None
        finally:
            _GIVEN.reset(token)

    @classmethod
    def variable(cls, field: str) -> str:
        """The environment variable of ``field``."""
        return f"{cls.model_config.get('env_prefix', PREFIX)}{field}".upper()

    @classmethod
    def _problem(cls, error: dict[str, Any]) -> str:
        """One error of pydantic as text: a group's own check names its variable itself; a type error is
        given the variable and the value."""
        message = error.get("msg", "")
        if error.get("type") == "value_error":
            return message.removeprefix("Value error, ")
        loc = error.get("loc") or ("?",)
        return f"{cls.variable(str(loc[0]))}={error.get('input')!r}: {message}"
