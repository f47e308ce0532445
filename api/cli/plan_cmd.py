"""``foldtune plan``: rank every valid folded layout of a model on a cluster with the cost model.

Prints how many configs were considered, valid, rejected (per rule, with an example) and pruned by
memory, then the best N with what limits each, whether foldtune's executor runs it (those it runs first;
``--megatron``: as Megatron-Core runs them, executable or not), their step-time and memory intervals, and the
breakdown of the best with where each term's constants come from. The order is robust by default: by the
pessimistic end of each layout's step-time interval (``--rank-by point``: by the point estimate).
``--explain LAYOUT`` judges one layout; ``--megatron-args`` prints the chosen (or explained) layout as
Megatron-LM arguments; ``--json`` prints the same content machine-readably.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from typing import Any

from api.cli._doc_lengths import load_document_lengths
from api.cli._model_args import add_hf_arguments, add_proxy_arguments, model_from_args
from api.cli.plan_multimodal import add_image_arguments, is_multimodal_request, run_multimodal
from costmodel.params import total_param_counts
from api.cli._shape_args import (add_gpu_argument, add_shape_arguments, check_profile_agrees, require_gpu,
                                 resolve_shape)
from api.cli._units import seconds, seconds_cell
from api.cli.arguments import add, top
from planner.enumerate import VPP_LIMIT, SearchSpace
from spec.pipeline_layout import PipelineSplit
from planner.megatron_args import format_megatron_args, megatron_args
from planner.rank import RANK_BY, explain_layout, plan, plan_precisions, smallest_fitting_cluster
from costmodel.uncertainty import RATE
from spec.documents import attention_share
from spec.errors import SpecError
from spec.layout_codec import ACTIVATION_OFFLOAD_MODULES, names_placement, placement_label
from spec.optimizer_dtypes import read_dtypes
from spec.inputs import build_specs
from spec.model_spec import ModelSpec
from spec.profile_io import load_profile
from spec.training_spec import CROSS_ENTROPY_FUSION_IMPLS, FP8_RECIPES
from api.cli._run_cost_args import (RunQuestion, add_run_cost_arguments, gpu_hours, hours, run_heading, run_question,
                                    usd)
from costmodel.training_run import training_run

HELP = "rank every valid folded layout for a model on a cluster (cost model only)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_request_arguments(parser)
    add(parser, "--top")
    add(parser, "--json")
    parser.add_argument("--explain", metavar="LAYOUT",
                        help='judge one layout, e.g. "tp2 pp4 ep8 mbs1" (any subset of a table label); '
                             'exits 0 when it is valid and fits in memory, else 1')
    parser.add_argument("--megatron-args", action="store_true",
                        help="also print the best (or explained) layout as Megatron-LM arguments")
    parser.add_argument("--megatron", action="store_true",
                        help="rank by step time alone: what Megatron-Core can run, Megatron's flex dispatcher "
                             "(DeepEP/HybridEP) searched too (default: the layouts foldtune's executor runs first; "
                             "each layout says whether it does, and why not)")
    parser.add_argument("--pareto", action="store_true",
                        help="time every fitting config and list the step-time/memory Pareto front (slower)")
    parser.add_argument("--rank-by", choices=RANK_BY, default="robust",
                        help="order of the ranked layouts: robust, by the pessimistic (high) end of each step-time "
                             "interval, or point, by the point estimate alone (default: robust)")
    add_run_cost_arguments(parser)
    add_image_arguments(parser)
    add(parser, "--search-precision", "plans each and reports the faster; --precision is then only the fallback")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="leave CUDA graphs out of the search (by default each layout is also tried with them on "
                             "GPU clusters; --explain judges the layout as its label says)")
    parser.add_argument("--workers", type=int, default=None, help=argparse.SUPPRESS)


def add_request_arguments(parser: argparse.ArgumentParser) -> None:
    """What a plan request is made of (the model, the cluster, the training's shape, the search space and the
    pricing switches): ``foldtune plan``'s and ``foldtune verify``'s, which plans the same way."""
    model = parser.add_mutually_exclusive_group(required=True)
    add(model, "--model", "e.g. mixtral-8x22b")
    add_hf_arguments(model)
    add_proxy_arguments(parser)
    add(parser, "--gpus", "whole nodes when several", required=True)
    add_gpu_argument(parser, local=False)
    add(parser, "--profile", "prices the layouts; its GPU kind is the --gpu, so give one of the two")
    add_shape_arguments(parser)
    parser.add_argument("--distributed-optimizer", choices=("on", "off", "auto"), default="auto",
                        help="force the distributed optimizer on/off, or try both (default: auto)")
    add(parser, "--routing")
    add(parser, "--capacity-factor")
    add(parser, "--pad-to-capacity")
    parser.add_argument("--imbalance", type=float, default=1.0,
                        help="busiest expert's tokens over the mean (default: 1.0, perfectly balanced)")
    parser.add_argument("--mbs-max", type=int, default=8, help="largest micro-batch size tried (default: 8)")
    parser.add_argument("--fused-window-sink-attention", action="store_true",
                        help="price attention layers with a sliding window or sinks (GPT-OSS) as Megatron's "
                             "fused kernel; default: foldtune's executor, an fp32 masked softmax over s x s")
    parser.add_argument("--doc-lengths", metavar="FILE|DIR",
                        help="price attention for packed sequences of documents of these lengths: a file of token "
                             "counts, or a dataset of `foldtune data prepare --pack` (its documents sampled); "
                             "causal attention then costs the sum of len^2/2 over documents, not seq^2/2")
    parser.add_argument("--vpp-max", type=int, default=4,
                        help=f"largest vpp (virtual stages per pipeline rank) tried, up to {VPP_LIMIT} (default: 4)")
    parser.add_argument("--pipeline-model-parallel-layout", metavar="LAYOUT",
                        help="Megatron's layout string, e.g. 'Et*3|(tt|)*29,m|L' (E embedding, t decoder layer, "
                             "m MTP layer, L loss, '|' between chunks); it fixes pp·vpp for every layout")
    parser.add_argument("--decoder-first-pipeline-num-layers", type=int, metavar="N",
                        help="decoder layers of the first pipeline stage (the middle stages share the rest)")
    parser.add_argument("--decoder-last-pipeline-num-layers", type=int, metavar="N",
                        help="decoder layers of the last pipeline stage")
    parser.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                        help="count the embedding as a layer of the pipeline split (its chunk holds one layer fewer)")
    parser.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                        help="count the loss as a layer of the pipeline split (its chunk holds one layer fewer)")
    parser.add_argument("--megatron-cross-entropy", action="store_true",
                        help="price Megatron's loss (whole logits, one fp32 softmax per head); default: foldtune's "
                             "executor, the output layer fused with the loss and blocked over the vocabulary")
    parser.add_argument("--gradient-accumulation-fusion", action="store_true",
                        help="price Megatron's fused weight-gradient accumulation into the fp32 main gradient")
    parser.add_argument("--sequence-parallel-regather", action="store_true",
                        help="price Megatron's sequence-parallel linears (input re-gathered in backward)")
    parser.add_argument("--transformer-engine-fp8", action="store_true",
                        help="price fp8 casts as Transformer Engine's (one fused cast-transpose per GEMM input); "
                             "default: foldtune's executor's quantisation")
    parser.add_argument("--fp8-recipe", choices=FP8_RECIPES, default="tensorwise",
                        help="Transformer Engine's fp8 scaling recipe (Megatron's --fp8-recipe; with "
                             "--transformer-engine-fp8): the scales its saved inputs and weights carry, and whether "
                             "linear_proj keeps an fp8 copy of the attention output (delayed) (default: tensorwise)")
    parser.add_argument("--fp8-param-gather", action="store_true",
                        help="price Megatron's fp8 primary weights (--fp8-param-gather): no 16-bit weight copy")
    parser.add_argument("--grad-reduce-in-bf16", action="store_true",
                        help="price Megatron's bf16 gradient buffer (--grad-reduce-in-bf16, Megatron-Bridge's "
                             "grad_reduce_in_fp32=False); default: fp32 main gradients")
    parser.add_argument("--cross-entropy-fusion-impl", choices=CROSS_ENTROPY_FUSION_IMPLS, default="native",
                        help="Megatron's fused loss (with --megatron-cross-entropy): native keeps an fp32 softmax "
                             "per head, te (Transformer Engine) the 16-bit logits only (default: native)")
    parser.add_argument("--megatron-memory", action="store_true",
                        help="price the tensors Megatron-Core keeps where they differ from foldtune's executor (its "
                             "MoE dispatcher, MLA's attention output, the distributed optimizer's shards)")
    parser.add_argument("--optimizer-offload", metavar="FRACTIONS", default="",
                        help="optimizer CPU offload fractions to try beside none, comma-separated, e.g. 0.5,1.0 "
                             "(Megatron's --optimizer-offload-fraction; with the distributed optimizer)")
    parser.add_argument("--optimizer-dtypes", metavar="TRIPLES", default="",
                        help="optimizer state dtypes to try beside fp32, comma-separated EXP_AVG+EXP_AVG_SQ+MAIN_PARAMS "
                             "triples, e.g. bf16+bf16+fp32,bf16+bf16+fp16 (Megatron's precision-aware optimizer: "
                             "--exp-avg-dtype, --exp-avg-sq-dtype, --main-params-dtype; with the distributed optimizer)")
    parser.add_argument("--activation-offload", metavar="MODULES", action="append", default=[],
                        help=f"a set of modules whose activations to try offloading to CPU memory, '+'-joined "
                             f"(modules: {'+'.join(ACTIVATION_OFFLOAD_MODULES)}); repeat for several sets")
    add(parser, "--min-headroom")


# ---- inputs ------------------------------------------------------------------------------------
def plan_specs(args: argparse.Namespace, command: str = "plan", base: ModelSpec | None = None):
    """(model, training, cluster) of a plan request's arguments (:func:`add_request_arguments`) for ``command``;
    SpecError naming every bad value. ``base``: the model to plan instead of the one the arguments name (a
    vision-language model's LLM)."""
    problems = []
    if top(args, command) < 1:
        problems.append(f"--top must be >= 1, got {args.top}")
    if args.mbs_max < 1:
        problems.append(f"--mbs-max must be >= 1, got {args.mbs_max}")
    if not 1 <= args.vpp_max <= VPP_LIMIT:
        problems.append(f"--vpp-max must be in 1..{VPP_LIMIT}, got {args.vpp_max}")
    problems += [f"pipeline options: {p}" for p in _split(args).problems()]
    if args.routing == "capacity" and args.capacity_factor is None:
        problems.append("--routing capacity needs --capacity-factor")
    if args.routing == "dropless" and args.capacity_factor is not None:
        problems.append("--capacity-factor needs --routing capacity")
    if args.pad_to_capacity and args.routing != "capacity":
        problems.append("--pad-to-capacity needs --routing capacity")
    if problems:
        raise SpecError("; ".join(problems))
    # the catalog's or the Hugging Face model, as the proxy asked for
    model = base if base is not None else model_from_args(args)
    if args.profile:
        gpu = load_profile(args.profile).gpu.name
        check_profile_agrees(args.gpu, gpu, args.profile)
    else:
        gpu = require_gpu(args, command, " or --profile FILE")
    shape = resolve_shape(args, gpu, command)
    return build_specs(model, args.gpus, gpu=args.gpu, profile=args.profile,
                       seq_length=shape.seq, global_batch_size=shape.gbs, precision=shape.precision,
                       distributed_optimizer={"on": True, "off": False, "auto": None}[args.distributed_optimizer],
                       routing_mode=args.routing, moe_expert_capacity_factor=args.capacity_factor,
                       moe_pad_expert_input_to_capacity=bool(args.pad_to_capacity),
                       moe_routing_imbalance=args.imbalance,
                       fused_window_sink_attention=args.fused_window_sink_attention,
                       megatron_cross_entropy=args.megatron_cross_entropy,
                       gradient_accumulation_fusion=args.gradient_accumulation_fusion,
                       sequence_parallel_regather=args.sequence_parallel_regather,
                       transformer_engine_fp8=args.transformer_engine_fp8,
                       fp8_recipe=args.fp8_recipe, fp8_param_gather=args.fp8_param_gather,
                       main_grads_fp32=not args.grad_reduce_in_bf16,
                       cross_entropy_fusion_impl=args.cross_entropy_fusion_impl,
                       megatron_memory=args.megatron_memory,
                       document_lengths=load_document_lengths(args.doc_lengths) if args.doc_lengths else None,
                       min_headroom=args.min_headroom)


def _split(args: argparse.Namespace) -> PipelineSplit:
    """Megatron's pipeline placement options of the command line."""
    return PipelineSplit(args.pipeline_model_parallel_layout, args.decoder_first_pipeline_num_layers,
                         args.decoder_last_pipeline_num_layers, args.account_for_embedding_in_pipeline_split,
                         args.account_for_loss_in_pipeline_split)


def _offload(args: argparse.Namespace) -> dict:
    """The SearchSpace knob-option fields of ``--optimizer-offload`` / ``--activation-offload`` /
    ``--optimizer-dtypes``."""
    try:
        fractions = tuple(float(f) for f in args.optimizer_offload.split(",") if f.strip())
    except ValueError:
        raise SpecError(f"--optimizer-offload takes comma-separated fractions, got {args.optimizer_offload!r}") from None
    try:
        dtypes = tuple(read_dtypes(t) for t in args.optimizer_dtypes.split(",") if t.strip())
    except ValueError as exc:
        raise SpecError(f"--optimizer-dtypes: {exc}") from None
    return {"optimizer_offload": fractions,
            "activation_offload": tuple(tuple(m for m in text.split("+") if m) for text in args.activation_offload),
            "optimizer_dtypes": dtypes}


def plan_space(args: argparse.Namespace):
    """The search space of a plan request's arguments."""
    precisions = SEARCHED_PRECISIONS if getattr(args, "search_precision", False) else None
    return SearchSpace(mbs_max=args.mbs_max, vpp_max=args.vpp_max, pipeline=_split(args), precisions=precisions,
                       cuda_graphs=not getattr(args, "no_cuda_graphs", False), **_offload(args))


SEARCHED_PRECISIONS = ("bf16", "fp8")  # what --search-precision plans
# PlanResult.megatron -> the JSON "ranking" (as POST /v1/plans answers)
_RANKING = {False: "executable_first", True: "megatron"}


def _explain_text(args: argparse.Namespace) -> str:
    """The --explain layout with the command line's placement options added (unless it names its own)."""
    text = args.explain
    if names_placement(text):
        return text
    return f"{text} {placement_label(_split(args))}".strip()


# ---- numbers -----------------------------------------------------------------------------------
def _gib(n: float) -> float:
    return n / 2**30


def _bytes(n: float) -> str:
    """Bytes as GiB with one decimal, or MiB/KiB for the tiny test models."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= 0.1 * size or unit == "KiB":
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


_seconds = seconds


def _count(n: float) -> str:
    """Parameter counts: 140.6 B, 39.2 B, 1.3 M."""
    return f"{n / 1e9:.1f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def _header(model, training, cluster, space) -> dict[str, Any]:
    total, active = total_param_counts(model)
    return {
        "model": model.name, "params_total": total, "params_active": active,
        "gpu": cluster.gpu.name, "num_gpus": cluster.num_gpus, "gpus_per_node": cluster.gpus_per_node,
        "num_nodes": cluster.num_nodes, "usable_hbm_bytes": cluster.usable_hbm_bytes,
        "min_headroom": cluster.min_headroom, "min_headroom_bytes": cluster.min_headroom_bytes,
        "training": training.to_dict(), "search_space": space.describe(),
    }


# ---- text --------------------------------------------------------------------------------------
def _mean(values) -> float:
    return sum(values) / len(values)


def _header_lines(h: dict[str, Any]) -> list[str]:
    t = h["training"]
    distopt = {None: "auto", True: "on", False: "off"}[t["distributed_optimizer"]]
    routing = (f"capacity factor {t['moe_expert_capacity_factor']:g}" if t["routing_mode"] == "capacity"
               else "dropless")
    return [
        f"model    {h['model']}: {_count(h['params_total'])} parameters, {_count(h['params_active'])} active per token",
        f"cluster  {h['num_gpus']} x {h['gpu']} ({h['num_nodes']} node{'s' if h['num_nodes'] > 1 else ''} of "
        f"{h['gpus_per_node']}), {_bytes(h['usable_hbm_bytes'])} usable per GPU, {_bytes(h['min_headroom_bytes'])} "
        f"kept free" + (f" ({h['min_headroom']:.0%} of its memory)" if h["min_headroom"] < 1 else ""),
        f"training seq {t['seq_length']}, global batch {t['global_batch_size']}, {t['precision']}, {routing} routing"
        + (f", imbalance {t['moe_routing_imbalance']:g}" if t["moe_routing_imbalance"] != 1.0 else "")
        + f", distributed optimizer {distopt}"
        + (", Megatron's fused window/sink attention" if t.get("fused_window_sink_attention") else "")
        + (", Megatron's loss" if t.get("megatron_cross_entropy") else "")
        + (", fused gradient accumulation" if t.get("gradient_accumulation_fusion") else "")
        + (", SP re-gather" if t.get("sequence_parallel_regather") else "")
        + (", Transformer Engine's fp8 casts" if t.get("transformer_engine_fp8") else "")
        + (f", fp8 recipe {t['fp8_recipe']}" if t.get("fp8_recipe", "tensorwise") != "tensorwise" else "")
        + (", fp8 primary weights" if t.get("fp8_param_gather") else "")
        + (", bf16 gradients" if not t.get("main_grads_fp32", True) else "")
        + (", Transformer Engine's fused loss" if t.get("cross_entropy_fusion_impl") == "te" else "")
        + (", Megatron-Core's saved tensors" if t.get("megatron_memory") else "")
        + (f", packed documents (mean {_mean(t['document_lengths']):.0f} tokens: attention x"
           f"{attention_share(t['document_lengths'], t['seq_length']):.3f})" if t.get("document_lengths") else ""),
        f"search   {h['search_space']}",
    ]


def _rule_lines(result) -> list[str]:
    enum = result.enumeration
    rejected = sum(enum.rejected.values())
    lines = [f"considered {enum.considered:,} configs: {enum.valid:,} valid, {rejected:,} rejected by rule"]
    for rule, count in sorted(enum.rejected.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {rule:<18} {count:>14,}  e.g. {enum.examples[rule].reason}")
    lines.append(f"pruned by memory: {result.pruned_by_memory:,} of {enum.valid:,} valid configs; {result.fitting:,} fit")
    mode = ("every fitting config timed" if result.exhaustive else
            f"{result.bound_calls:,} of the time estimates are lower bounds; configs whose bound cannot beat the "
            f"top {len(result.ranked)} were never timed")
    lines.append(f"ranked {result.fitting:,} configs in {result.enumerate_seconds + result.rank_seconds:.2f} s "
                 f"(enumerate {result.enumerate_seconds:.2f} s; {result.memory_calls:,} memory and "
                 f"{result.time_calls:,} time estimates on {result.workers} process"
                 f"{'es' if result.workers > 1 else ''}; {mode})")
    lines.append(_order_line(result))
    if result.order_violations or result.bound_violations:
        lines.append(f"warning: the cost model broke the ranker's monotone properties {result.order_violations} + "
                     f"{result.bound_violations} times (see planner/rank.py); the list is sorted but may miss a "
                     f"config: run with --pareto for an exhaustive ranking")
    return lines


def _ranking_line(megatron: bool) -> str:
    return ("ranked by step time, as Megatron-Core runs them ('runs' says whether foldtune's executor does too)"
            if megatron else "ranked with the layouts foldtune's executor runs first ('runs'; --megatron: all alike, "
                             "as Megatron-Core runs them)")


def _order_line(result) -> str:
    """What the ranked list is ordered by (``--rank-by``), and how sure the robust order is."""
    if result.rank_by == "point":
        return "order: by the point estimate of the step time (--rank-by point)"
    rate = result.ranked[0].interval.rate if result.ranked and result.ranked[0].interval else RATE
    return (f"order: robust, by the high end of each step-time interval ({rate:.0%} intervals from where each term's "
            f"constants come from; --rank-by point for the point estimate)"
            + ("" if result.robust_exact else f"; among the {result.robust_shortlist} fastest by point estimate"))


def _interval_line(e) -> str:
    """A layout's step-time and memory intervals and its least certain term, under its table row."""
    iv = e.interval
    if iv is None:
        return ""
    worst = _least_certain(e)
    return (f"step {seconds_cell(iv.step_time.low).strip()}-{seconds_cell(iv.step_time.high).strip()} s, memory "
            f"{_bytes(iv.memory.low)}-{_bytes(iv.memory.high)}"
            + (f"; most uncertain: {worst.term}, {worst.provenance} ({worst.note})" if worst is not None else ""))


def _least_certain(e):
    """The term adding the most seconds to the interval's high end (its exposed and hidden seconds times its
    high width), or None."""
    t = e.time
    hidden = dict(t.hidden)
    used = [p for p in e.interval.terms if p.provenance != "derived" and (t.term(p.term) > 0 or hidden.get(p.term))]
    return max(used, key=lambda p: (t.term(p.term) + hidden.get(p.term, 0.0)) * p.width.high, default=None)


def _table(estimates, capacity: float) -> list[str]:
    head = (f"{'#':>3}  {'step (s)':>10}  {'tok/s/GPU':>9}  {'TFLOPS':>7}  {'MFU':>5}  {'memory / usable':>19}  "
            f"{'limiter':<12}  {'runs':<4}  layout")
    lines = [head, "-" * len(head)]
    for i, e in enumerate(estimates, 1):
        t = e.time
        lines.append(f"{i:>3}  {seconds_cell(t.step_time):>10}  {t.tokens_per_s_per_gpu:>9,.0f}  "
                     f"{t.tflops_per_gpu:>7.4g}  {t.mfu:>5.1%}  {_bytes(e.memory.total) + ' / ' + _bytes(capacity):>19}  "
                     f"{e.limiter:<12}  {'yes' if e.executable else 'no':<4}  {e.config.label()}")
        lines.append(f"{'':>3}  {'':>10}  -> {e.explanation}")
        if not e.executable:
            lines.append(f"{'':>3}  {'':>10}  -> Megatron-Core only, foldtune's executor: {e.executable_reason}")
        interval = _interval_line(e)
        if interval:
            lines.append(f"{'':>3}  {'':>10}     {interval}")
    return lines


def _breakdown_lines(e) -> list[str]:
    t = e.time
    hidden = dict(t.hidden)
    iv = e.interval
    prov = {p.term: p for p in iv.terms} if iv is not None else {}
    step = _seconds(t.step_time) + (f" ({seconds_cell(iv.step_time.low).strip()}-"
                                    f"{seconds_cell(iv.step_time.high).strip()} s, {iv.rate:.0%} interval)"
                                    if iv is not None else "")
    lines = [f"time breakdown of {e.config.label()}: step {step}, bottleneck {t.bottleneck}",
             f"  {'term':<16} {'exposed (s)':>11} {'share':>6} {'hidden (s)':>11}" + ("  constants" if prov else "")]
    for name, value in sorted(t.terms, key=lambda kv: -kv[1]):
        if value or hidden.get(name):
            share = value / t.step_time if t.step_time else 0.0
            p = prov.get(name)
            where = (f"  {p.provenance} -{p.width.low:.0%}/+{p.width.high:.0%}: {p.note}"
                     if p is not None and p.provenance != "derived" else f"  {p.note}" if p is not None else "")
            lines.append(f"  {name:<16} {seconds_cell(value):>11} {share:>6.1%} "
                         f"{seconds_cell(hidden.get(name, 0.0)):>11}" + where)
    m = e.memory
    lines.append(f"memory breakdown of the most loaded GPU (pipeline stage {m.stage}): {_bytes(m.total)}"
                 + (f" ({_bytes(iv.memory.low)}-{_bytes(iv.memory.high)})" if iv is not None else "")
                 + f", headroom {_bytes(e.memory_headroom_bytes)}")
    for name in ("weights", "grads", "optimizer", "activations", "logits", "comm_buffers", "allocator_overhead"):
        value = getattr(m, name)
        share = value / m.total if m.total else 0.0
        lines.append(f"  {name:<18} {_bytes(value):>11} {share:>6.1%}")
    if m.host_offloaded:
        lines.append(f"  offloaded to the host (not on the GPU): {_bytes(m.host_offloaded)}")
    return lines


def _runs(question: RunQuestion | None, estimates, training, cluster) -> list:
    """The TrainingRun of each estimate for ``--tokens`` (none without it)."""
    if question is None:
        return []
    return [training_run(question.tokens, e.time.step_time, training.seq_length, training.global_batch_size,
                         cluster.num_gpus, question.price_per_gpu_hour) for e in estimates]


def _runs_json(runs, estimates) -> list[dict]:
    return [{"layout": e.config.label(), **r.to_dict()} for r, e in zip(runs, estimates)]


def _run_lines(runs, estimates, training) -> list[str]:
    """The ``--tokens`` answer: one heading, then wall time, GPU-hours and cost per layout (ranked order)."""
    priced = runs[0].cost_usd is not None
    head = f"{'#':>3}  {'step':>10}  {'wall time':>22}  {'GPU-hours':>14}  " + (f"{'cost':>18}  " if priced else "") \
        + "layout"
    lines = [run_heading(runs[0], training.seq_length, training.global_batch_size), head, "-" * len(head)]
    for i, (r, e) in enumerate(zip(runs, estimates), 1):
        lines.append(f"{i:>3}  {_seconds(r.step_time_s):>10}  {hours(r.wall_s):>22}  {gpu_hours(r.gpu_hours):>14}  "
                     + (f"{usd(r.cost_usd):>18}  " if priced else "") + e.config.label())
    return lines


def _argv(config, model, training) -> list[str]:
    """Megatron-LM arguments as an argv list (JSON: no shell quoting needed)."""
    return [token for flag in megatron_args(config, model, training) for token in flag]


def _explain(args, model, training, cluster, question: RunQuestion | None) -> int:
    verdict = explain_layout(model, training, cluster, _explain_text(args))
    header = _header(model, training, cluster, plan_space(args))
    fitting = [verdict.estimate] if verdict.estimate is not None and verdict.estimate.fits else []
    runs = _runs(question, fitting, training, cluster)
    if args.json:
        out = {**header, "explain": args.explain, "valid": verdict.valid,
               "rejections": [{"rule": r.rule, "reason": r.reason} for r in verdict.rejections],
               "estimate": verdict.estimate.to_dict() if verdict.estimate else None}
        if question is not None:
            out["training_run"] = runs[0].to_dict() if runs else None
        if args.megatron_args and verdict.estimate:
            out["megatron_args"] = _argv(verdict.config, model, training)
        print(json.dumps(out, indent=2))
        return _explain_exit_code(verdict)
    print("\n".join(_header_lines(header)[:3]))
    label = verdict.config.label() if verdict.config else args.explain
    if not verdict.valid:
        print(f"layout   {label}: INVALID")
        for r in verdict.rejections:
            print(f"  [{r.rule}] {r.reason}")
        return 1
    e = verdict.estimate
    print(f"layout   {label}: valid, {'fits' if e.fits else 'does NOT fit'} in memory, "
          + ("runs on foldtune's executor" if e.executable else
             f"Megatron-Core only (foldtune's executor: {e.executable_reason})"))
    print(f"predicted step {_seconds(e.time.step_time)}, {e.time.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
          f"{e.time.tflops_per_gpu:.4g} TFLOPS/GPU, MFU {e.time.mfu:.1%}, memory {_bytes(e.memory.total)} of "
          f"{_bytes(cluster.usable_hbm_bytes)} usable ({_bytes(cluster.min_headroom_bytes)} kept free); "
          f"limiter {e.limiter}: {e.explanation}")
    print("\n".join(_breakdown_lines(e)))
    if runs:
        print("\n" + "\n".join(_run_lines(runs, fitting, training)))
    if args.megatron_args:
        print("\nMegatron-LM arguments:\n" + format_megatron_args(e.config, model, training))
    return _explain_exit_code(verdict)


def _fitting_hint(model, training, cluster, space) -> str:
    """How many GPUs of this kind would fit the model at this sequence length and batch (doubling the count)."""
    found = smallest_fitting_cluster(model, training, cluster, space=space)
    if found is None:
        return (f"no count of {cluster.gpu.name} GPUs up to 16,384 fits it at seq {training.seq_length} and global "
                f"batch {training.global_batch_size} (a larger --gbs allows more data parallelism; a GPU with more "
                f"memory, a shorter sequence or a smaller model would fit)")
    n, best = found
    return (f"{n} x {cluster.gpu.name} would fit (e.g. {best.config.label()}: {_bytes(best.memory.total)} of "
            f"{_bytes(best.memory.total + best.memory_headroom_bytes)} per GPU); so would a GPU with more memory, "
            f"a shorter sequence or a smaller model")


def _explain_exit_code(verdict) -> int:
    """0 when the layout is valid and fits in memory, else 1: the same answer with or without --json."""
    return 0 if verdict.valid and verdict.estimate is not None and verdict.estimate.fits else 1


def run(args: argparse.Namespace) -> int:
    # After the sweep the cost models' caches hold ~10^6 objects, and every cyclic collection the reporting
    # triggers rescans them (measured: ~5 % of a large plan); nothing here makes cycles worth collecting.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _run(args)
    except BrokenPipeError:  # `foldtune plan ... | head`: the reader left; exit quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        if gc_was_enabled:
            gc.enable()


def _run(args: argparse.Namespace) -> int:
    if is_multimodal_request(args):  # a vision-language model: the encoder's layout and placement searched too
        return run_multimodal(args, plan_specs)
    question = run_question(args)  # before planning: a bad --tokens costs nothing
    model, training, cluster = plan_specs(args)
    if args.explain is not None:
        return _explain(args, model, training, cluster, question)
    space = plan_space(args)
    if space.precisions is None:
        result = plan(model, training, cluster, top=top(args, "plan"), exhaustive=args.pareto, space=space,
                      workers=args.workers, rank_by=args.rank_by, megatron=args.megatron)
        searched = None
    else:  # the fastest precision's plan; the others' best step times are reported beside it
        results = plan_precisions(model, training, cluster, top=top(args, "plan"), exhaustive=args.pareto,
                                  space=space, workers=args.workers, rank_by=args.rank_by, megatron=args.megatron)
        result, training = results[0], results[0].training
        searched = {r.training.precision: (r.best.time.step_time if r.best else None) for r in results}
    header = _header(model, training, cluster, space)
    if searched is not None:
        header["precision_search"] = searched
    best = result.best
    if args.json:
        enum = result.enumeration
        out = {
            **header,
            "considered": enum.considered, "valid": enum.valid,
            "rejected": {rule: {"count": n, "example": enum.examples[rule].reason} for rule, n in enum.rejected.items()},
            "pruned_by_memory": result.pruned_by_memory, "fitting": result.fitting,
            "timing": {"enumerate_s": result.enumerate_seconds, "rank_s": result.rank_seconds,
                       "memory_calls": result.memory_calls, "time_calls": result.time_calls,
                       "bound_calls": result.bound_calls, "workers": result.workers,
                       "exhaustive": result.exhaustive, "order_violations": result.order_violations,
                       "bound_violations": result.bound_violations},
            "ranking": _RANKING[result.megatron], "rank_by": result.rank_by, "robust_exact": result.robust_exact, "robust_shortlist": result.robust_shortlist,
            "ranked": [e.to_dict() for e in result.ranked],
            "pareto": [e.to_dict() for e in result.pareto] if result.exhaustive else None,
            "closest": result.closest.to_dict() if result.closest else None,
        }
        if question is not None:  # the --tokens answer of every ranked layout, in ranked order
            out["training_runs"] = _runs_json(_runs(question, result.ranked, training, cluster), result.ranked)
        if args.megatron_args and best:
            out["megatron_args"] = _argv(best.config, model, training)
        if best is None:  # how many GPUs of this kind would fit, as the text says
            found = smallest_fitting_cluster(model, training, cluster, space=space)
            out["fits_on"] = None if found is None else {"num_gpus": found[0], "best": found[1].to_dict()}
        print(json.dumps(out, indent=2))
        return 0 if best else 1
    print("\n".join(_header_lines(header) + _rule_lines(result)))
    if searched is not None:
        print("precision searched (best layout's step time): " + ", ".join(
            f"{p} {'no fit' if t is None else _seconds(t)}" for p, t in searched.items()) + f"; planned {training.precision}")
    if best is None:
        c = result.closest
        print(f"\nNO LAYOUT FITS in {_bytes(cluster.usable_hbm_bytes)} per GPU. Closest: {c.config.label()}")
        print(f"  {c.explanation}")
        print("\n".join("  " + line for line in _breakdown_lines(c)))
        print("  " + _fitting_hint(model, training, cluster, space))
        return 1
    print()
    print(_ranking_line(result.megatron))
    print("\n".join(_table(result.ranked, cluster.usable_hbm_bytes)))
    if result.exhaustive:
        print(f"\nPareto front (step time vs memory), {len(result.pareto)} configs:")
        print("\n".join(_table(result.pareto, cluster.usable_hbm_bytes)))
    if question is not None:
        print("\n" + "\n".join(_run_lines(_runs(question, result.ranked, training, cluster), result.ranked,
                                           training)))
    print()
    print("\n".join(_breakdown_lines(best)))
    if args.megatron_args:
        print("\nMegatron-LM arguments of the best layout:\n" + format_megatron_args(best.config, model, training))
    sys.stdout.flush()
    return 0
