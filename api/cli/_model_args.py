"""The model arguments of ``foldtune profile``, ``tune``, ``submit`` and ``train``: ``--model``,
``--model-file``, or a Hugging Face model (``--model-dir DIR`` / ``--hf-config FILE``, :mod:`spec.hf_config`),
and the proxy (``--layers N``, ``--proxy tiny``; ``plan`` and ``best`` take these too), resolved into a
request body (for the API's schema) or a ModelSpec (for a local run), and the front door's check of a local run.

Each refusal is a FoldtuneError, which ``foldtune`` prints as one line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

from api.cli.arguments import add
from api.service.capability import check_layout_runnable, check_model_runnable
from api.service.errors import RuleViolation
from spec.catalog import get_model
from spec.errors import SpecError
from spec.hf_config import HFModel, load_hf_model, model_from_hf_config, read_hf_config
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.proxy import ProxyError, proxy_model
from spec.training_spec import TrainingSpec
from spec.validity import cuda_graphs_rule


def add_model_arguments(parser: argparse.ArgumentParser, *, required: bool = True,
                        note: str | None = None) -> None:
    """``--model`` / ``--model-file`` / ``--model-dir`` / ``--hf-config`` (one of them, ``required`` or not)
    and the proxy options ``--layers`` and ``--proxy``."""
    model = parser.add_mutually_exclusive_group(required=required)
    add(model, "--model", note)
    add(model, "--model-file")
    add_hf_arguments(model)
    add_proxy_arguments(parser)


def add_proxy_arguments(parser: argparse.ArgumentParser) -> None:
    """``--layers N`` and ``--proxy tiny``: the proxy of the named model a command runs (plans, looks up)."""
    add(parser, "--layers")
    add(parser, "--proxy")


def add_hf_arguments(group) -> None:
    """``--model-dir DIR`` and ``--hf-config FILE``: a Hugging Face model's config.json (docs/huggingface.md)."""
    add(group, "--model-dir")
    add(group, "--hf-config")


def hf_model_from_args(args: argparse.Namespace) -> HFModel | None:
    """The mapped Hugging Face model of ``--model-dir`` / ``--hf-config``, None when neither is given."""
    path = getattr(args, "model_dir", None) or getattr(args, "hf_config", None)
    return load_hf_model(path) if path else None


def _read_model_file(path_text: str) -> dict[str, Any]:
    path = Path(path_text)
    try:
        text = path.read_text()
        spec = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except OSError as exc:
        raise SpecError(f"cannot read model file {str(path)!r}: {exc.strerror}") from None
    except Exception as exc:  # yaml/json raise many types; one line is what the user needs
        raise SpecError(f"model file {str(path)!r} is not valid JSON/YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(spec, dict):
        raise SpecError(f"model file {str(path)!r} must hold a mapping of ModelSpec fields")
    spec.setdefault("name", path.stem)
    return spec


def model_body(args: argparse.Namespace) -> dict[str, Any]:
    """The model fields of a job or training body: ``model`` or ``model_spec``, and the proxy's
    ``num_layers_override`` / ``proxy`` when given."""
    # a file wins over a default --model (the group makes giving both on the command line an error)
    path = getattr(args, "model_dir", None) or getattr(args, "hf_config", None)
    if path:
        config, name = read_hf_config(path)
        model_from_hf_config(config, name, where=str(path))  # refuse here, with the file's name, not at the server
        body: dict[str, Any] = {"hf_config": config, "hf_name": name}
    elif args.model_file:
        body = {"model_spec": _read_model_file(args.model_file)}
    else:
        body = {"model": args.model}
    if args.layers is not None:
        body["num_layers_override"] = args.layers
    if args.proxy is not None:
        body["proxy"] = args.proxy
    return body


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    """The ModelSpec a local run builds: the catalog model or the file's, as the proxy asked for."""
    hf = hf_model_from_args(args)
    if hf is not None:
        base = hf.spec
    else:
        model_file = getattr(args, "model_file", None)  # plan names no model file
        base = ModelSpec.from_dict(_read_model_file(model_file)) if model_file else get_model(args.model)
    try:
        return proxy_model(base, args.layers, args.proxy)
    except ProxyError as exc:
        raise SpecError(f"--{'layers' if exc.rule == 'proxy_layers' else 'proxy'}: {exc} [{exc.rule}]") from None


def check_local_run(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, gpu: str | None = None) -> None:
    """The front door of a local run (``profile``, ``train``): the executor's model rule, then every rule of the
    rule book (the batch rule included, and on the ranks ``gpu`` names, 'cpu' or a GPU, the GPU's rules), a
    RuleViolation naming the first, before any rank process starts."""
    check_model_runnable(model, "--model")
    check_layout_runnable(model, training, config, "--layout")  # the rule book, the batch rule included
    device = cuda_graphs_rule(config, gpu)
    if device is not None:
        raise RuleViolation("--layout", device.rule, device.reason)
