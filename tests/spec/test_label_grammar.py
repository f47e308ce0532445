"""One place defines the label grammar: spec/layout_codec.py.

Two halves. No product module spells a label token itself (a source scan: a knob token such as
``precision=`` or a size token such as ``tp{n}`` in a string literal outside the codec fails here). And every
label the modules print parses back with the one parser, knob suffixes included: the planner's ranking and
``plan`` (table, breakdown, JSON, ``--explain``), the guided search's trials and best layout with their
``precision=`` suffix (events, rows, the study's attributes, ``tune``'s printed lines), the export record, the
executor's measurement and rule messages, and the forms older jobs stored.
"""

from __future__ import annotations

import ast
import io
import json
import re
from pathlib import Path

import optuna
import pytest

from api.cli._export import best_record
from api.cli.main import main
from api.cli.tune_cmd import TrialPrinter
from executor.profile import profile_layout
from planner.rank import plan
from planner.search import ATTR_CONFIG, ATTR_LAYOUT, ATTR_PRED_TERMS, Candidate, SearchBudget, run_search, search_space
from spec.inputs import build_specs
from spec.layout_codec import Labelled, current_optuna_params, optuna_key
from spec.parallel_config import ParallelConfig
from spec.validity import executor_layout_rules, refusal

ROOT = Path(__file__).resolve().parents[2]
CODEC = ROOT / "spec" / "layout_codec.py"
PACKAGES = ("spec", "costmodel", "planner", "executor", "db", "api")
KNOB_TOKEN = re.compile(r"(?:^|[\s,(])(precision|recompute|dispatcher|distopt|ep_overlap|tp_overlap|opt_offload"
                        r"|act_offload|exp_avg|exp_avg_sq|main_params|cuda_graphs"
                        r"|pp_first|pp_last|pp_account|layout)=")
SIZE_PREFIX = re.compile(r"(?:^|[\s,(])(tp|cp|pp|vpp|ep|etp|dp|edp|mbs)$")
TINY = ["plan", "--model", "tiny-moe", "--gpus", "8", "--gpu", "cpu", "--seq", "128", "--gbs", "16"]
optuna.logging.set_verbosity(optuna.logging.WARNING)


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, kinds) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def _spelled_tokens(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of string literals that spell a label token: a knob token anywhere, or a size token's name
    right before a formatted value that ends the word (``f"tp{tp} "``, not ``f"cp{cp}_ms"``)."""
    docs, found = _docstrings(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            parts = node.values
            for i, part in enumerate(parts[:-1]):
                after = parts[i + 2] if i + 2 < len(parts) else None
                ends_word = after is None or (isinstance(after, ast.Constant) and str(after.value)[:1] in " ,")
                if (isinstance(part, ast.Constant) and isinstance(parts[i + 1], ast.FormattedValue)
                        and SIZE_PREFIX.search(str(part.value)) and ends_word):
                    found.append((node.lineno, str(part.value)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if KNOB_TOKEN.search(node.value):
                found.append((node.lineno, node.value[:60]))
    return found


def test_no_module_but_the_codec_spells_a_label_token():
    spelled = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == CODEC or "migrations" in path.parts:
                continue
            spelled += [f"{path.relative_to(ROOT)}:{line}: {text!r}"
                        for line, text in _spelled_tokens(ast.parse(path.read_text()))]
    assert spelled == []


def test_the_scan_finds_a_spelled_token():
    """The scan above is not vacuous: the codec itself spells every token, and a hand-built suffix is found."""
    assert len(_spelled_tokens(ast.parse(CODEC.read_text()))) >= 10
    assert _spelled_tokens(ast.parse('x = label + f" precision={p}"\ny = f"tp{tp} cp{cp}"'))


# ---- every label a module prints parses back ------------------------------------------------------------
def _reads_back(label: str, world_size: int) -> Labelled:
    """The one parser's reading of a printed label; its own label is the printed text (nothing dropped)."""
    read = ParallelConfig.parse_labelled(label, world_size=world_size)
    assert read.label() == label, (label, read.label())
    return read


def test_plan_prints_labels_the_codec_reads(capsys):
    assert main(TINY + ["--top", "3"]) == 0
    text = capsys.readouterr().out
    rows = re.findall(r"^\s*\d+\s+.*?\s{2}(tp\d+ .*)$", text, re.M)
    breakdown = re.findall(r"^time breakdown of (.*?): step", text, re.M)
    assert len(rows) == 3 and breakdown
    assert main(TINY + ["--top", "3", "--json"]) == 0
    ranked = [r["layout"] for r in json.loads(capsys.readouterr().out)["ranked"]]
    assert main(TINY + ["--explain", "tp2, ep4 mbs2 dispatcher=allgather"]) == 0
    explained = re.findall(r"^layout\s+(.*?): valid", capsys.readouterr().out, re.M)
    assert explained == ["tp2 cp1 pp1 vpp1 ep4 etp1 dp4 edp2 mbs2 dispatcher=allgather"]
    for label in rows + breakdown + ranked + explained:
        _reads_back(label, 8)
    assert ranked == rows  # the JSON and the table name the same layouts


def test_the_planner_ranking_prints_labels_the_codec_reads():
    model, training, cluster = build_specs("mixtral-8x7b", 64, gpu="h100-sxm", seq_length=4096,
                                           global_batch_size=256)
    found = plan(model, training, cluster, top=5)
    for est in found.ranked:
        assert _reads_back(est.to_dict()["layout"], 64) == Labelled(est.config)


class _Measured:
    """What the stand-in machine reports for a trial."""

    ok, pruned, peak_allocated_bytes, tokens_per_expert = True, False, None, None

    def __init__(self, seconds: float) -> None:
        self.step_time = seconds


def _searched(tmp_path) -> tuple[list[dict], object, optuna.Study]:
    """A guided search over two precisions (candidates carry theirs), measured by a stand-in machine."""
    cands = []
    for tp in (1, 2):
        for precision in ("bf16", "fp8"):
            cfg = ParallelConfig(world_size=4, tp=tp, ep=2, recompute_granularity="selective",
                                 overlap_moe_expert_parallel_comm=True)
            cands.append(Candidate(cfg, 1.0 + tp / 10, (("gemm", 1.0),), 1e9, precision=precision))
    events: list[dict] = []
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    result = run_search(cands, lambda config, report: _Measured(1.0 + config.tp / 10), capacity_bytes=80e9,
                        budget=SearchBudget(max_trials=4), storage=storage, study_name="grammar",
                        on_event=lambda kind, data: events.append({"kind": kind, **data}))
    return events, result, optuna.load_study(study_name="grammar", storage=storage)


def test_the_search_prints_trial_labels_with_their_precision_suffix(tmp_path):
    events, result, study = _searched(tmp_path)
    printed = io.StringIO()
    printer = TrialPrinter(printed)
    for e in events:
        printer(e["kind"], e)
    printer("job_finished", {"job_id": 1, "status": "succeeded", "error": None, "rows": result.rows,
                             "result": {**result.calibration.to_dict(), "stopped_because": result.stopped_because},
                             "best": result.best_config, "best_precision": result.best_precision,
                             "best_step_time": result.best_step_time})
    text = printed.getvalue()
    labels = ([e["layout"] for e in events if "layout" in e] + [e["best_layout"] for e in events if "best_layout" in e]
              + [r.layout for r in result.rows] + [t.user_attrs[ATTR_LAYOUT] for t in study.trials]
              + re.findall(r"trial\s+\d+\s+(tp\d+.*?)\s+predicted", text)
              + re.findall(r"best layout: (.*?)  \S+ ms per step", text))
    assert len(labels) >= 4 * 5 + 2 and all(" precision=" in label for label in labels)
    for label in labels:
        read = _reads_back(label, 4)
        assert read.precision in ("bf16", "fp8") and read.config.overlap_moe_expert_parallel_comm
    for t in study.trials:  # the label and the Optuna parameters the study stored name the same point
        read = ParallelConfig.parse_labelled(t.user_attrs[ATTR_LAYOUT])
        assert optuna_key(read.optuna_params()) == optuna_key(t.params)


def test_the_export_record_and_the_executor_print_labels_the_codec_reads():
    model, training, _ = build_specs("tiny-moe", 4, gpu="cpu", seq_length=128, global_batch_size=6)
    config = ParallelConfig(world_size=4, tp=2, ep=2, micro_batch_size=2, optimizer_cpu_offload_fraction=0.5,
                            activation_offload_modules=("moe",))
    record = best_record({"id": 7, "status": "succeeded", "model": model.name, "model_spec": model.to_dict(),
                          "training": training.to_dict(), "cluster": {"gpu": "cpu", "num_gpus": 4},
                          "best_trial": {"number": 3, "config": config.to_dict(), "step_time_s": 0.25,
                                         "precision": "bf16"}})
    assert _reads_back(record["layout"], 4) == Labelled(config)
    # gbs 6 does not split into micro-batches of 2 over dp 2: the measurement fails before any rank starts
    measured = profile_layout(model, training, config)
    assert not measured.ok and _reads_back(measured.layout, 4) == Labelled(config)
    overlapped = ParallelConfig(world_size=4, pp=2, vpp=2, ep=2, overlap_moe_expert_parallel_comm=True)
    message = refusal(model, overlapped, executor_layout_rules(model, overlapped, 128) or [])
    _reads_back(re.match(r"layout (.*?) for ", message).group(1), 4)


# ---- the forms older jobs stored ------------------------------------------------------------------------
@pytest.mark.parametrize("stored, world, expected", [
    # a trial label of a job that searched precision (db Trial.label)
    ("tp2 cp1 pp1 vpp1 ep2 etp1 dp2 edp2 mbs1 ep_overlap=on precision=fp8", 4,
     Labelled(ParallelConfig(4, tp=2, ep=2, overlap_moe_expert_parallel_comm=True), "fp8")),
    # labels from before offload and EP overlap were knobs: the knobs read as off
    ("tp1 cp1 pp2 vpp2 ep4 etp1 dp4 edp1 mbs2 recompute=full", 8,
     Labelled(ParallelConfig(8, pp=2, vpp=2, ep=4, micro_batch_size=2, recompute_granularity="full"))),
    ("tp1 cp1 pp1 vpp1 ep1 etp1 dp8 edp8 mbs1 recompute=full:0", 8,
     Labelled(ParallelConfig(8, recompute_granularity="full"))),
])
def test_stored_labels_of_older_jobs_still_read(stored, world, expected):
    assert ParallelConfig.parse_labelled(stored, world_size=world) == expected


def test_stored_optuna_params_of_every_version_name_the_same_point():
    config = ParallelConfig(8, tp=2, ep=4, recompute_granularity="full")
    current = config.to_optuna_params()
    first = {k: v for k, v in current.items() if k not in ("ep_overlap", "opt_offload", "act_offload")}
    first["recompute"] = "full:0"  # how the first studies spelled a whole-stage full recompute
    before_offload = {k: v for k, v in current.items() if k not in ("opt_offload", "act_offload")}
    for old in (first, before_offload):
        assert current_optuna_params(old) == current
        assert optuna_key(old) == optuna_key(current)
        assert ParallelConfig.from_optuna_params(old, 8) == config
    assert optuna_key({**first, "precision": "fp8"}) == optuna_key(Labelled(config, "fp8").optuna_params())


def test_stored_config_dicts_of_older_jobs_still_read():
    """A Trial/Training ``config`` column from before the offload, EP-overlap and placement fields existed (and
    an export's, with the derived dp and edp) reads with those fields at their defaults."""
    old = {"world_size": 8, "tp": 2, "cp": 1, "pp": 2, "vpp": 1, "ep": 2, "etp": 1, "micro_batch_size": 1,
           "sequence_parallel": True, "recompute_granularity": "selective", "recompute_modules": ["core_attn"],
           "recompute_num_layers": 0, "moe_token_dispatcher_type": "alltoall", "use_distributed_optimizer": True,
           "overlap_grad_reduce": True, "overlap_param_gather": True, "tp_comm_overlap": False, "dp": 2, "edp": 2}
    config = ParallelConfig.from_dict(old)
    assert config == ParallelConfig(8, tp=2, pp=2, ep=2, recompute_granularity="selective")
    assert ParallelConfig.parse(config.label()) == config


def test_a_study_begun_before_the_newer_knobs_resumes_without_measuring_its_trial_again(tmp_path):
    """A stored trial without the parameters added since (EP overlap, offload) is the same point as the
    current candidate: the resumed search counts it as measured and measures only the other layout."""
    stored = ParallelConfig(4, ep=4, recompute_granularity="full")
    other = stored.replace(ep=2)
    cands = [Candidate(stored, 1.0, (("gemm", 1.0),), 1e9), Candidate(other, 1.2, (("gemm", 1.2),), 1e9)]
    old = {k: v for k, v in stored.to_optuna_params().items() if k not in ("ep_overlap", "opt_offload", "act_offload")}
    storage = f"sqlite:///{tmp_path / 'old.db'}"
    study = optuna.create_study(storage=storage, study_name="old", direction="minimize")
    space = search_space(cands)
    study.add_trial(optuna.trial.create_trial(
        params=old, distributions={k: space[k] for k in old}, value=1.0,
        user_attrs={ATTR_LAYOUT: stored.label(), ATTR_CONFIG: stored.to_dict(), ATTR_PRED_TERMS: [["gemm", 1.0]]}))
    ran = []
    result = run_search(cands, lambda config, report: ran.append(config) or _Measured(1.1), capacity_bytes=80e9,
                        budget=SearchBudget(max_trials=2), storage=storage, study_name="old")
    assert ran == [other]
    assert result.best_config == stored and [r.layout for r in result.rows] == [stored.label(), other.label()]
