"""The ``hf_config`` field of the job, plan and training bodies: a Hugging Face config.json sent inline.

Never a server path (a multi-user service must not read files a user names). The object is bounded
(:data:`MAX_HF_CONFIG_BYTES` as JSON) and mapped by :mod:`spec.hf_config` into the body's ``model_spec``
before any other check, so the service sees an ordinary inline model; a field the mapping does not
understand is a 422 problem of type ``hf_config_rules`` naming it.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, Field, model_validator
from pydantic_core import PydanticCustomError

from api.schemas.common import Name
from spec.errors import FoldtuneError
from spec.hf_config import model_from_hf_config

#: The largest inline config accepted (bytes of compact JSON); published ones are 1 to 3 KiB.
MAX_HF_CONFIG_BYTES = 64 * 1024


class HFConfigIn(BaseModel):
    """``hf_config`` (with an optional ``hf_name``) instead of ``model`` / ``model_spec``."""

    hf_config: dict[str, Any] | None = Field(
        None, description="a Hugging Face config.json object (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3, "
                          f"GPT-OSS), at most {MAX_HF_CONFIG_BYTES} bytes of JSON; mapped to model_spec")
    hf_name: Name | None = Field(None, description="the model's name (default: hf-<model_type>)")

    @model_validator(mode="before")
    @classmethod
    def _map_hf_config(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("hf_config") is None:
            if isinstance(data, dict) and data.get("hf_name") is not None:
                raise PydanticCustomError("hf_name_needs_hf_config", "hf_name names an hf_config; give both")
            return data
        config = data["hf_config"]
        if data.get("model") is not None or data.get("model_spec") is not None:
            raise PydanticCustomError("model_xor_model_spec", "give exactly one of model, model_spec or hf_config")
        if not isinstance(config, dict):
            raise PydanticCustomError("hf_config_rules", "hf_config must be a JSON object (a config.json)")
        try:
            size = len(json.dumps(config, separators=(",", ":")))
        except (TypeError, ValueError, RecursionError):
            raise PydanticCustomError("hf_config_rules", "hf_config must be plain JSON") from None
        if size > MAX_HF_CONFIG_BYTES:
            raise PydanticCustomError("hf_config_rules", "hf_config is {size} bytes of JSON, more than {limit}",
                                      {"size": size, "limit": MAX_HF_CONFIG_BYTES})
        name = data.get("hf_name") or f"hf-{config.get('model_type', 'model')}"
        if not isinstance(name, str) or not name.strip() or len(name) > 200 or "\x00" in name:
            raise PydanticCustomError("hf_config_rules", "hf_name must be 1 to 200 characters without NUL")
        try:
            mapped = model_from_hf_config(config, name.strip(), where="body.hf_config")
        except FoldtuneError as exc:
            raise PydanticCustomError("hf_config_rules", "{reason}", {"reason": str(exc)}) from None
        except Exception as exc:  # noqa: BLE001 - a client's odd JSON must be a 422, never a 500
            raise PydanticCustomError("hf_config_rules", "hf_config cannot be mapped: {reason}",
                                      {"reason": str(exc) or type(exc).__name__}) from None
        rest = {k: v for k, v in data.items() if k not in ("hf_config", "hf_name")}
        return {**rest, "model_spec": mapped.spec.to_dict()}
