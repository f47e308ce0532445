"""The HTTP client commands' ``FOLDTUNE_*`` variables (``submit``, ``jobs``, ``best``, ``trainings``; a
pydantic-settings group, docs/settings.md): ``FOLDTUNE_URL`` (the API's base URL), ``FOLDTUNE_API_KEY`` and
``FOLDTUNE_HTTP_ATTEMPTS`` (tries of one request, retries included: api/cli/_retry.py)."""

from __future__ import annotations

from pydantic import Field

from api.http.settings import DEFAULT_HOST, DEFAULT_PORT
from api.env_settings import FoldtuneEnv

DEFAULT_URL = f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"
DEFAULT_HTTP_ATTEMPTS = 4
MAX_HTTP_ATTEMPTS = 20  # with the backoff cap of 8 s: at most ~2.5 minutes of waiting on one request


class ClientEnv(FoldtuneEnv):
    """``url``: the API's base URL; ``api_key`` (None: the local key file's); ``http_attempts``: 1 to 20."""

    what = "client"
    url: str = DEFAULT_URL
    api_key: str | None = None
    http_attempts: int = Field(DEFAULT_HTTP_ATTEMPTS, ge=1, le=MAX_HTTP_ATTEMPTS)
