"""The documented commands work as written: every ``foldtune ...`` of README.md's and docs/*.md's code blocks
(tests/doc_commands.py extracts them) is parsed by the CLI's own parser, its options spelled out in full, its
model, GPU and layout labels checked as the command checks them; the cheap ones (plans, data preparation, CPU
profiles) are run. A renamed or removed flag, an abbreviated one, a model or GPU the catalog lacks or a layout
label that contradicts itself fails here, naming the doc and line."""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
from pathlib import Path

import pytest

from doc_commands import ROOT, DocCommand, doc_commands

DOCS = doc_commands()

# Commands the docs show that this file parses but does not run, and why (they run elsewhere in the suite).
NOT_RUN = {
    "tune": "a real tuning job with a calibration first: tests/api/test_tune_cli.py (slow)",
    "serve": "a server that runs until stopped: tests/api/test_serve_process.py",
    "runner": "a runner that runs until stopped: tests/api/test_runner_sigterm.py",
    "submit": "needs a running API: tests/api/test_cli.py",
    "jobs": "needs a running API: tests/api/test_cli.py",
    "best": "needs a running API and a finished job: tests/api/test_best.py",
    "trainings": "needs a running API: tests/api/test_everyday_cli.py",
    "keys": "writes the service database: tests/api/test_cli.py",
    "calibrate": "GPUs, a Ray cluster or a minute of CPU benchmarks: tests/api/test_calibrate_cli.py",
    "train": "hundreds of training steps: tests/executor/test_training.py",
    "export-hf": "needs a training checkpoint: tests/hf/",
    "verify": "slices of three layouts, tens of seconds on a CPU: tests/api/test_verify_cli.py (slow)",
}


def _id(doc: DocCommand) -> str:
    return f"{doc.where}:{doc.command}"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse has no public way to reach its subparsers
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def parse(doc: DocCommand) -> argparse.Namespace:
    """``doc``'s arguments parsed by the parser ``foldtune`` itself builds, nothing run; an argparse refusal fails
    the test with its message."""
    from api.cli.main import build_parser, command_of

    parser = build_parser(command_of(doc.argv), lazy=True)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(list(doc.argv))
    except SystemExit:
        pytest.fail(f"{doc.where}: `foldtune {' '.join(doc.argv)}` is refused: {err.getvalue().strip()}")


def abbreviated_options(doc: DocCommand) -> list[str]:
    """Options of ``doc`` that are no full option name of its command (argparse would take a unique prefix, so a
    renamed flag whose old name is a prefix of another one would still parse)."""
    from api.cli.main import build_parser, command_of

    parser = build_parser(command_of(doc.argv), lazy=True)
    names = {s for a in parser._actions for s in a.option_strings}
    for word in doc.argv:  # down the chain of subcommands the arguments name (calibrate merge, data prepare)
        sub = _subparsers(parser).get(word)
        if sub is not None:
            parser = sub
            names |= {s for a in parser._actions for s in a.option_strings}
    return [w for w in doc.argv if w.startswith("--") and w.split("=", 1)[0] not in names]


def check_meaning(doc: DocCommand, args: argparse.Namespace) -> None:
    """What the command checks before it runs anything: catalog model and GPU names, layout labels."""
    from spec.catalog import get_hardware, get_model
    from spec.parallel_config import ParallelConfig

    if getattr(args, "catalog", None):
        return  # the names come from the user's own catalog file
    if getattr(args, "model", None) and not getattr(args, "model_dir", None):
        from spec.vl_catalog import get_vl_model, is_vl_model
        if is_vl_model(args.model):  # a vision-language model (its catalog, or ENCODER+LLM)
            get_vl_model(args.model)
        else:
            get_model(args.model.split("@", 1)[0])
    if isinstance(getattr(args, "gpu", None), str):
        get_hardware(args.gpu)
    if doc.command == "profile":
        from api.cli.profile_cmd import _config
        _config(args)  # the layout the command would run: a contradictory label is refused here
    if doc.command == "train" and args.layout:
        ParallelConfig.parse(args.layout, world_size=args.gpus)
    if doc.command == "plan" and args.explain:
        from spec.multimodal_layout import MultimodalLayout
        if getattr(args, "images_per_sample", None) is not None:  # a multimodal label: the LLM's + the encoder's
            MultimodalLayout.parse(args.explain, args.gpus)
        else:
            ParallelConfig.read_label(args.explain)


def test_the_docs_show_every_kind_of_command():
    """The extraction finds what the docs show (so the tests below cannot pass on nothing)."""
    commands = {doc.command for doc in DOCS}
    assert len(DOCS) >= 40
    assert commands >= {"tune", "plan", "profile", "calibrate", "serve", "runner", "submit", "jobs", "best",
                        "trainings", "data", "train", "keys", "export-hf"}
    readme = [doc.argv for doc in DOCS if doc.path.name == "README.md"]
    assert readme[0] == ("tune",)  # the quick start's main job
    # `foldtune plan ... --explain X` is the full plan command above it plus --explain X
    explain = next(argv for argv in readme if "--explain" in argv)
    assert explain[:3] == ("plan", "--model", "mixtral-8x22b") and explain[-2] == "--explain"


def test_the_harness_fails_a_bad_flag_an_abbreviation_and_a_contradictory_label(tmp_path):
    from spec.errors import FoldtuneError

    doc = tmp_path / "doc.md"
    doc.write_text("```bash\nfoldtune plan --model tiny-moe --gpus 4 --no-such-flag\n"
                   "foldtune plan --model tiny-moe --gpus 4 --gpu cpu --mbs-m 2  # a prefix of --mbs-max\n"
                   "foldtune profile --model tiny-moe --gpu cpu --layout \"tp2 cp1 pp1 vpp1 ep2 etp1 dp1 edp2 mbs1\"\n"
                   "```\n")
    from doc_commands import commands_in
    bad_flag, prefix, label = commands_in(doc)
    with pytest.raises(pytest.fail.Exception, match="unrecognized arguments: --no-such-flag"):
        parse(bad_flag)
    assert abbreviated_options(prefix) == ["--mbs-m"]
    with pytest.raises(FoldtuneError, match="contradicts world size"):
        check_meaning(label, parse(label))


@pytest.mark.parametrize("doc", DOCS, ids=_id)
def test_every_documented_command_parses_as_written(doc):
    args = parse(doc)
    assert abbreviated_options(doc) == [], f"{doc.where}: not a full option name of `foldtune {doc.command}`"
    check_meaning(doc, args)


def test_every_documented_command_is_run_here_or_says_where():
    run_here = {doc.command for doc in DOCS if _runnable(doc)}
    assert {doc.command for doc in DOCS} <= run_here | set(NOT_RUN)
    # run through a longer one: the README's first plan and first profile, each spelled out again with more
    # options below it; every kind of runnable command is still run
    skipped = [doc.where for doc in DOCS if _runnable(doc) and _run_by_a_longer_one(doc)]
    assert len(skipped) == 2, skipped
    assert {doc.command for doc in DOCS if _runnable(doc)} == {p.values[0].command for p in RUNS}


def _runnable(doc: DocCommand) -> bool:
    """Commands this file runs: plans of catalog models (the cost model only), data preparation of the repo's own
    text, and profiles on CPU ranks; not those naming files the docs assume (a Hugging Face directory, a profile
    written by calibrate, a tokenizer)."""
    argv = doc.argv
    if any(flag in argv for flag in ("--model-dir", "--profile", "--tokenizer", "--hf-config", "--model-file")):
        return False
    if doc.command == "plan":
        return True
    if doc.command == "data":
        return all(not a.startswith("$") for a in argv)
    return doc.command == "profile" and "cpu" in argv


def _quick(doc: DocCommand) -> bool:
    """A second or two on a quiet machine: one layout judged, or the docs tokenised."""
    return doc.command == "data" or (doc.command == "plan" and "--explain" in doc.argv)


def _run_by_a_longer_one(doc: DocCommand) -> bool:
    """True when another runnable command of the docs is ``doc`` with more options (the ``foldtune plan ...
    --json`` lines spell out the plan above them): running that one runs ``doc``'s command, model and layout,
    and ``doc`` itself is parsed and checked above. Each run is seconds to a minute of the cost model or of
    CPU ranks."""
    return any(other.command == doc.command and len(other.argv) > len(doc.argv)
               and other.argv[:len(doc.argv)] == doc.argv for other in DOCS if _runnable(other))


RUNS = [pytest.param(doc, id=_id(doc), marks=() if _quick(doc) else pytest.mark.slow)
        for doc in DOCS if _runnable(doc) and not _run_by_a_longer_one(doc)]


@pytest.mark.parametrize("doc", RUNS)
def test_documented_command_runs(doc, tmp_path, monkeypatch, capsys):
    import executor.profile
    from api.cli.main import main
    from executor.launch_local import launch

    # relative paths as in the docs: the repository's README.md and docs/ are there, outputs land in tmp_path
    for name in ("README.md", "docs"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    # the CPU ranks of a documented profile are forked from this process rather than spawned (each spawned rank
    # re-imports torch: ~20 s a command on two cores); what the command parses, runs and prints is the same
    monkeypatch.setattr(executor.profile, "launch_local", functools.partial(launch, start_method="fork"))
    code = main(list(doc.argv))
    out, err = capsys.readouterr()
    assert code == 0, f"{doc.where}: `foldtune {' '.join(doc.argv)}` exited {code}: {err.strip()}"
    assert out.strip(), f"{doc.where}: printed nothing"
    if doc.command == "data":
        out_dir = Path(doc.argv[doc.argv.index("--out") + 1])
        assert out_dir.is_dir() and any(out_dir.iterdir())
