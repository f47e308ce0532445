"""`foldtune plan` end to end on the real cost model: output, JSON, --explain, --megatron-args, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from api.cli.main import main

TINY = ["plan", "--model", "tiny-moe", "--gpus", "8", "--gpu", "cpu", "--seq", "128", "--gbs", "16"]


def run(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_prints_counts_table_and_breakdown(capsys):
    code, out, err = run(capsys, TINY + ["--top", "4"])
    assert code == 0 and err == ""
    for text in ("model    tiny-moe", "cluster  8 x cpu", "search   micro-batch <= 8", "valid,",
                 "rejected by rule", "heads_tp", "e.g. num_attention_heads (4) is not divisible by tp (8)",
                 "pruned by memory:", "ranked ", "memory / usable", "time breakdown of", "memory breakdown"):
        assert text in out, text
    rows = [line for line in out.splitlines() if line[:3].strip().isdigit() and "tp" in line]
    assert [int(r[:3]) for r in rows] == [1, 2, 3, 4]
    assert out.count("-> ") == 4  # one explanation line per row


def test_plan_json_is_complete_and_consistent(capsys):
    code, out, _ = run(capsys, TINY + ["--top", "3", "--json", "--megatron-args"])
    assert code == 0
    data = json.loads(out)
    assert data["model"] == "tiny-moe" and data["num_gpus"] == 8 and data["params_total"] > data["params_active"]
    assert data["considered"] == data["valid"] + sum(r["count"] for r in data["rejected"].values())
    assert data["valid"] == data["fitting"] + data["pruned_by_memory"]
    ranked = data["ranked"]
    assert data["rank_by"] == "robust" and isinstance(data["robust_exact"], bool)
    highs = [e["step_time_interval_s"]["high"] for e in ranked]  # robust: by the intervals' pessimistic ends
    assert len(ranked) == 3 and highs == sorted(highs)
    for e in ranked:
        assert e["step_time_interval_s"]["low"] <= e["step_time_s"] <= e["step_time_interval_s"]["high"]
        assert e["memory_interval_bytes"]["low"] <= e["memory_bytes"]["total"] <= e["memory_interval_bytes"]["high"]
        assert e["time_provenance"]["gemm"]["provenance"] in ("measured", "extrapolated", "datasheet")
    first = ranked[0]
    assert first["fits"] and first["memory_bytes"]["total"] > 0 and "gemm" in first["time_terms_s"]
    assert first["layout"].startswith("tp") and first["explanation"]
    argv = data["megatron_args"]  # an argv list, ready for subprocess
    assert argv[0] == "--tensor-model-parallel-size" and argv[1].isdigit() and "--global-batch-size" in argv


def test_plan_prints_each_layouts_intervals_and_each_terms_constants(capsys):
    code, out, _ = run(capsys, TINY + ["--top", "2"])
    assert code == 0
    assert "order: robust, by the high end of each step-time interval (80% intervals" in out
    intervals = [line for line in out.splitlines() if line.strip().startswith("step ") and "memory" in line]
    assert len(intervals) == 2 and all(" s, memory " in line and "most uncertain:" in line for line in intervals)
    breakdown = out[out.index("time breakdown of"):]
    assert "80% interval)" in breakdown.splitlines()[0] and "constants" in breakdown.splitlines()[1]
    assert "datasheet -25%/+100%" in breakdown or "measured -15%/+25%" in breakdown
    code, point, _ = run(capsys, TINY + ["--top", "5", "--rank-by", "point", "--json"])
    data = json.loads(point)
    times = [e["step_time_s"] for e in data["ranked"]]
    assert code == 0 and data["rank_by"] == "point" and times == sorted(times)
    code, text, _ = run(capsys, TINY + ["--top", "1", "--rank-by", "point"])
    assert "order: by the point estimate of the step time (--rank-by point)" in text


def test_explain_valid_layout_with_megatron_args(capsys):
    code, out, _ = run(capsys, TINY + ["--explain", "tp2 ep4 mbs2", "--megatron-args"])
    assert code == 0
    assert "tp2 cp1 pp1 vpp1 ep4 etp1 dp4 edp2 mbs2: valid, fits in memory" in out
    assert "time breakdown" in out and "memory breakdown" in out
    assert "--expert-model-parallel-size 4 \\" in out and "--sequence-parallel" in out


def test_explain_invalid_layouts_give_a_verdict_not_an_error(capsys):
    code, out, err = run(capsys, TINY + ["--explain", "tp8 ep8"])
    assert code == 1 and err == ""
    assert "INVALID" in out and "[heads_tp]" in out
    code, out, _ = run(capsys, TINY + ["--explain", "tp3"])
    assert code == 1 and "[world_dense] tp·cp·pp = 3·1·1 = 3 does not divide the world size 8" in out


def test_explain_exit_code_is_the_same_with_and_without_json(capsys):
    """Valid but out of memory (Mixtral-8x22B replicated over TP8 on 128 H100s) exits 1 either way; a valid
    layout that fits exits 0 either way."""
    big = ["plan", "--model", "mixtral-8x22b", "--gpus", "128", "--gpu", "h100-sxm", "--seq", "4096", "--gbs", "256"]
    code, out, _ = run(capsys, big + ["--explain", "tp8 pp1 ep1 mbs8"])
    assert code == 1 and "does NOT fit in memory" in out
    code, out, _ = run(capsys, big + ["--explain", "tp8 pp1 ep1 mbs8", "--json"])
    verdict = json.loads(out)
    assert code == 1 and verdict["valid"] and not verdict["estimate"]["fits"]
    for extra in ([], ["--json"]):
        code, _, _ = run(capsys, TINY + ["--explain", "tp2 ep4 mbs2"] + extra)
        assert code == 0


def test_pareto_lists_the_front(capsys):
    code, out, _ = run(capsys, TINY + ["--top", "2", "--pareto", "--mbs-max", "2"])
    assert code == 0 and "Pareto front (step time vs memory)" in out and "every fitting config timed" in out


def test_nothing_fits_names_the_closest(capsys):
    code, out, _ = run(capsys, ["plan", "--model", "deepseek-v3", "--gpus", "8", "--gpu", "h100-sxm", "--seq", "4096", "--gbs", "8", "--top", "3"])
    assert code == 1
    assert "NO LAYOUT FITS in" in out and "Closest:" in out and "GiB usable" in out
    assert "256 x h100-sxm would fit (e.g. tp" in out  # how many GPUs of this kind would hold it
    # the same in JSON, on a smaller model (DeepSeek-V3's scan up to 256 GPUs is the text's above)
    code, out, _ = run(capsys, ["plan", "--model", "mixtral-8x7b", "--gpus", "2", "--gpu", "h100-sxm", "--seq", "4096",
                                "--gbs", "8", "--json"])
    assert code == 1 and json.loads(out)["fits_on"]["num_gpus"] == 16


BAD = [
    (["plan", "--model", "gpt-5", "--gpus", "8", "--gpu", "h100", "--seq", "4096", "--gbs", "8"], "unknown model 'gpt-5'"),
    (["plan", "--model", "mixtral-8x7", "--gpus", "8", "--gpu", "h100", "--seq", "4096", "--gbs", "8"],
     "unknown model 'mixtral-8x7' (did you mean 'mixtral-8x7b'?)"),
    (["plan", "--model", "mixtral-8x7b", "--gpus", "8", "--gbs", "8"], "does not guess its hardware: give --gpu NAME"),
    (["plan", "--model", "mixtral-8x7b", "--gpus", "8", "--gpu", "h100", "--gbs", "8"],
     "does not guess the training shape: give --seq N (tokens)"),
    (["plan", "--model", "mixtral-8x7b", "--gpus", "12", "--gpu", "h100", "--seq", "4096", "--gbs", "24"],
     "num_gpus (12) must be a multiple of gpus_per_node (8)"),
    (["plan", "--model", "small-moe", "--gpus", "64", "--gpu", "h100", "--seq", "2", "--gbs", "3"], "no valid layout of small-moe"),
    (TINY + ["--explain", "tp2 banana"], "cannot parse layout token 'banana'"),
    (TINY + ["--routing", "capacity"], "--routing capacity needs --capacity-factor"),
    (TINY + ["--gpu", "tpu-v9"], "unknown GPU 'tpu-v9'"),
    (TINY + ["--top", "0"], "--top must be >= 1"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_input_is_one_error_line(capsys, argv, message):
    code, out, err = run(capsys, argv)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("foldtune: error: ") and message in lines[0], err
    assert "Traceback" not in err


def test_malformed_catalog_yaml_is_one_error_line(capsys, tmp_path):
    bad = tmp_path / "cat.yaml"
    bad.write_text("models:\n  x: [unclosed\n")
    code, out, err = run(capsys, ["--catalog", str(bad)] + TINY)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("foldtune: error: catalog file")


def test_module_entry_point_never_shows_a_traceback():
    proc = subprocess.run([sys.executable, "-m", "api.cli.main", "plan", "--model", "nope", "--gpus", "8", "--gpu", "h100", "--seq", "4096", "--gbs", "8"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("foldtune: error: unknown model 'nope'")


def test_fused_window_sink_attention_reaches_the_cost_model(capsys):
    """GPT-OSS: the executor's fp32 masked softmax over the whole score matrix against Megatron's fused kernel."""
    argv = ["plan", "--model", "gpt-oss-120b", "--gpus", "64", "--gpu", "h100-sxm", "--seq", "4096", "--gbs", "512", "--json",
            "--explain", "tp2 pp2 ep16 mbs1"]
    code, out, _ = run(capsys, argv)
    ours = json.loads(out)
    code_fused, out, _ = run(capsys, argv + ["--fused-window-sink-attention"])
    theirs = json.loads(out)
    assert not ours["training"]["fused_window_sink_attention"] and theirs["training"]["fused_window_sink_attention"]
    assert (code, code_fused) == (1, 0)  # the executor's s x s probabilities do not fit; Megatron's layout does
    assert not ours["estimate"]["fits"] and theirs["estimate"]["fits"]
    assert ours["estimate"]["step_time_s"] > 2 * theirs["estimate"]["step_time_s"]
    code, out, _ = run(capsys, argv[:-3] + ["--top", "1", "--fused-window-sink-attention"])
    assert "Megatron's fused window/sink attention" in out


def test_plan_explain_accepts_the_distopt_off_label_tune_prints(capsys):
    label = "tp1 cp1 pp1 vpp1 ep2 etp1 dp4 edp2 mbs1 distopt=off"  # as tune's trial lines print it
    code = main(["plan", "--model", "tiny-moe", "--gpus", "4", "--gpu", "cpu", "--explain", label])
    out = capsys.readouterr().out
    assert code == 0 and f"layout   {label}: valid, fits in memory" in out, out


def test_min_headroom_prunes_and_shows_in_the_header_and_explain(capsys):
    big = ["plan", "--model", "mixtral-8x22b", "--gpus", "128", "--gpu", "h100-sxm", "--seq", "4096", "--gbs", "256",
           "--json", "--top", "1"]
    code, out, _ = run(capsys, big)
    default = json.loads(out)
    # 24 GiB kept free leaves 54.5 GiB: less than the default's best needs (about 58 GiB), more than others
    code_roomy, out, _ = run(capsys, big + ["--min-headroom", "24GiB"])
    roomy = json.loads(out)
    assert (code, code_roomy) == (0, 0)
    assert default["min_headroom"] == 0.05 and default["min_headroom_bytes"] == int(0.05 * 80 * 2**30)
    assert roomy["min_headroom_bytes"] == 24 * 2**30
    assert roomy["usable_hbm_bytes"] == 80 * 2**30 - int(1.5 * 2**30) - 24 * 2**30
    assert roomy["fitting"] < default["fitting"]
    assert roomy["ranked"][0]["memory_bytes"]["total"] <= roomy["usable_hbm_bytes"]
    # the default's best does not fit with 24 GiB kept free: --explain exits 1 with and without --json
    layout = default["ranked"][0]["layout"]
    assert default["ranked"][0]["memory_bytes"]["total"] > roomy["usable_hbm_bytes"]
    code, text, _ = run(capsys, big[:-3] + ["--min-headroom", "24GiB", "--explain", layout])
    assert code == 1 and "24.0 GiB kept free" in text
    code, text, _ = run(capsys, big[:-3] + ["--min-headroom", "24GiB", "--explain", layout, "--json"])
    assert code == 1 and json.loads(text)["min_headroom_bytes"] == 24 * 2**30
    code, out, _ = run(capsys, big[:-3] + ["--explain", layout])
    assert code == 0 and "4.0 GiB kept free" in out and "5% of its memory" in out


def test_min_headroom_bad_values_are_usage_errors(capsys):
    for bad in ("0.95", "-1", "lots", "3 parsecs"):
        with pytest.raises(SystemExit) as exc:
            main(TINY + ["--min-headroom", bad])
        assert exc.value.code == 2
        assert "--min-headroom" in capsys.readouterr().err


def test_megatron_switches_reach_the_cost_model(capsys):
    argv = ["plan", "--model", "qwen3-235b-a22b", "--gpus", "256", "--gpu", "h100-sxm", "--seq", "4096", "--gbs", "1024",
            "--json",
            "--explain", "tp4 pp1 ep8 mbs2 recompute=full"]  # one stage: the loss is on the reported GPU
    _, out, _ = run(capsys, argv)
    ours = json.loads(out)
    _, out, _ = run(capsys, argv + ["--megatron-cross-entropy", "--gradient-accumulation-fusion",
                                    "--sequence-parallel-regather", "--transformer-engine-fp8"])
    theirs = json.loads(out)
    t = theirs["training"]
    assert t["megatron_cross_entropy"] and t["gradient_accumulation_fusion"] and t["sequence_parallel_regather"]
    assert t["transformer_engine_fp8"] and not ours["training"]["transformer_engine_fp8"]
    assert not ours["training"]["megatron_cross_entropy"]
    # 8192 tokens, 38016 vocabulary rows a rank, h 4096: the executor's 2**26-logit block (6 B each), the bf16
    # weight gradient and the 4-byte log-sum-exp per token; its bf16 logits (594 MiB) are kept, but the layer's
    # backward working set and dispatch buffers (1.0 GiB), which they never meet, cover them. Megatron's whole
    # bf16 logits and one fp32 softmax
    rows = 152064 // 4  # 151936 padded to a multiple of 128·4
    details = ours["estimate"]["memory_bytes"]["details"]
    assert 8192 * rows * 2 < details["allocator.backward_working_set"] + details["comm.moe.dispatch_combine"]
    assert details["logits.kept_logits_beyond_layer_work"] == 0
    assert ours["estimate"]["memory_bytes"]["logits"] == 2**26 * 6 + rows * 4096 * 2 + 8192 * 4
    assert theirs["estimate"]["memory_bytes"]["logits"] == 8192 * rows * 6


def test_plan_builds_only_its_own_parser():
    """`foldtune plan` imports no other command's module: FastAPI (serve), torch (calibrate, profile) and Ray
    stay out of the process, whose start-up is part of the planner's time bar."""
    code = ("import sys; from api.cli.main import main; "
            "rc = main(['plan', '--model', 'tiny-moe', '--gpus', '8', '--gpu', 'cpu', '--gbs', '16', '--top', '1']); "
            "print(sorted(m for m in ('fastapi', 'torch', 'ray', 'uvicorn', 'api.cli.serve_cmd') if m in sys.modules)); "
            "sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


# tiny-moe with one KV head: Megatron replicates it over TP; the executor splits KV heads over TP (rule
# executor_heads_tp), so of its tp2 layouts, some of the 20 fastest on 4 CPU ranks, it runs none
MQA_CATALOG = ("models:\n  tiny-mqa-cli:\n    num_layers: 2\n    hidden_size: 64\n    num_attention_heads: 4\n"
               "    num_query_groups: 1\n    ffn_hidden_size: 128\n    vocab_size: 256\n    max_position_embeddings: 256\n"
               "    num_experts: 8\n    moe_router_topk: 2\n    moe_ffn_hidden_size: 32\n"
               "    make_vocab_size_divisible_by: 8\n")
MQA = ["plan", "--model", "tiny-mqa-cli", "--gpus", "4", "--gpu", "cpu", "--seq", "64", "--gbs", "8", "--top", "20"]


def test_plan_says_which_layouts_the_executor_runs_and_ranks_them_first(capsys, tmp_path):
    catalog = tmp_path / "mqa.yaml"
    catalog.write_text(MQA_CATALOG)
    # 60 deep: ranked as Megatron runs them, the flex dispatcher's layouts join the tp2 ones among the fastest
    code, out, _ = run(capsys, ["--catalog", str(catalog)] + MQA + ["--json", "--megatron", "--rank-by", "point",
                                                                     "--top", "60"])
    assert code == 0
    megatron = json.loads(out)
    assert megatron["ranking"] == "megatron"
    times = [e["step_time_s"] for e in megatron["ranked"]]
    assert times == sorted(times)
    # refused: tp2 layouts (one KV head) and, ranked as Megatron runs them, the flex dispatcher's
    everything_refused = [e for e in megatron["ranked"] if not e["executable"]]
    refused = [e for e in everything_refused if e["executable_reason"].startswith("[executor_heads_tp]")]
    assert refused and all(e["config"]["tp"] == 2 for e in refused)
    assert all(e in refused or "[executor_dispatcher]" in e["executable_reason"] for e in everything_refused)
    code, out, _ = run(capsys, ["--catalog", str(catalog)] + MQA + ["--json", "--rank-by", "point"])
    default = json.loads(out)
    assert default["ranking"] == "executable_first" and len(default["ranked"]) == 20
    assert all(e["executable"] is True and e["executable_reason"] is None for e in default["ranked"])
    assert default["ranked"][0]["layout"] == megatron["ranked"][0]["layout"]
    # the text: a 'runs' column, and the reason under a layout only Megatron-Core runs
    code, out, _ = run(capsys, ["--catalog", str(catalog)] + MQA + ["--megatron", "--rank-by", "point", "--top", "60"])
    assert "ranked by step time, as Megatron-Core runs them" in out and "  runs  layout" in out
    assert out.count("-> Megatron-Core only, foldtune's executor: [executor_heads_tp]") == len(refused)
    code, out, _ = run(capsys, ["--catalog", str(catalog)] + MQA + ["--explain", "tp2 ep2"])
    assert code == 0 and "Megatron-Core only (foldtune's executor: [executor_heads_tp]" in out


def test_the_top_mixtral_8x22b_pick_on_128_h100s_is_executable(capsys):
    """Issue 37's bar: every ranked layout says whether foldtune's executor runs it, and the top pick (the EP
    overlap under an interleaved pipeline, which the executor runs as Megatron's combined 1F1B) does."""
    code, out, _ = run(capsys, ["plan", "--model", "mixtral-8x22b", "--gpus", "128", "--gpu", "h100-sxm", "--seq",
                                "4096", "--gbs", "256", "--json"])
    assert code == 0
    ranked = json.loads(out)["ranked"]
    assert len(ranked) == 10
    assert all(isinstance(e["executable"], bool) and (e["executable_reason"] is None) == e["executable"]
               for e in ranked)
    assert all(e["step_time_interval_s"]["low"] <= e["step_time_s"] <= e["step_time_interval_s"]["high"]
               and e["memory_interval_bytes"]["low"] <= e["memory_bytes"]["total"] <= e["memory_interval_bytes"]["high"]
               for e in ranked)
    assert ranked[0]["executable"]
    # by the point estimate the fastest pick overlaps the EP all-to-alls under an interleaved pipeline (the
    # robust order may prefer a layout whose exposed all-to-all rests on fewer unmeasured constants): runnable too
    code, out, _ = run(capsys, ["plan", "--model", "mixtral-8x22b", "--gpus", "128", "--gpu", "h100-sxm", "--seq",
                                "4096", "--gbs", "256", "--json", "--rank-by", "point"])
    top = json.loads(out)["ranked"][0]
    assert top["executable"] and top["config"]["overlap_moe_expert_parallel_comm"]
    assert top["config"]["pp"] > 1 and top["config"]["vpp"] > 1
