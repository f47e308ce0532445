"""The CLI's HTTP client for the foldtune API: base URL and key from flags or FOLDTUNE_URL /
FOLDTUNE_API_KEY, and every failure (no server, a problem response) as one FoldtuneError line."""

from __future__ import annotations

import argparse
import os
from typing import Any

import httpx

from api.cli.arguments import add
from api.cli._local_key import given_key, key_file
from api.http.settings import DEFAULT_HOST, DEFAULT_PORT
from spec.errors import FoldtuneError

DEFAULT_URL = f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"


class ApiClientError(FoldtuneError):
    """The API could not be reached or answered with a problem."""


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    add(parser, "--url")
    add(parser, "--api-key")


class ApiClient:
    """Calls ``/v1`` endpoints and returns their JSON bodies."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ApiClient:
        url = args.url or os.environ.get("FOLDTUNE_URL") or DEFAULT_URL
        key = given_key(args.api_key)
        if not key:
            raise ApiClientError(f"no API key: pass --api-key or set FOLDTUNE_API_KEY (create one with "
                                 f"`foldtune keys create NAME`; `foldtune tune` writes one to {key_file()})")
        return cls(url, key)

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.ConnectError:
            raise ApiClientError(f"cannot reach the foldtune API at {self.url} "
                                 "(is `foldtune serve` running?)") from None
        except httpx.TimeoutException:
            raise ApiClientError(f"the foldtune API at {self.url} did not answer in time") from None
        except httpx.HTTPError as exc:
            raise ApiClientError(f"request to {self.url}{path} failed: {exc}") from None
        if response.status_code >= 400:
            raise ApiClientError(_problem_line(response))
        return response.json()

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None})

    def post(self, path: str, body: Any = None, headers: dict[str, str] | None = None) -> Any:
        return self.request("POST", path, json=body, headers=headers)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _problem_line(response) -> str:
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {response.status_code} from the API: {response.text[:200]}"
    title = body.get("title") or f"HTTP {response.status_code}"
    rules = body.get("errors") or []
    if rules:
        return f"{title}: " + "; ".join(f"{r.get('loc')}: {r.get('message')} [{r.get('rule')}]" for r in rules)
    return f"{title}: {body['detail']}" if body.get("detail") else title

