"""bench/plan_speed.py rewrites only its own section of docs/benchmarks.md (other benchmarks share the file)."""

from __future__ import annotations

from bench import plan_speed


def load_bench():
    """The benchmark module, as an installed package module (no path loading)."""
    return plan_speed


def test_section_is_replaced_in_place_and_others_kept(tmp_path, monkeypatch):
    bench = load_bench()
    doc = tmp_path / "benchmarks.md"
    monkeypatch.setattr(bench, "DOC", doc)
    bench.write_section("## Planner speed\n\nfirst\n")
    assert doc.read_text() == "# Benchmarks\n\n## Planner speed\n\nfirst\n"
    doc.write_text(doc.read_text() + "\n## Executor\n\nexecutor table\n")
    bench.write_section("## Planner speed\n\nsecond\n")
    text = doc.read_text()
    assert "first" not in text and "second" in text and "## Executor\n\nexecutor table" in text
    assert text.index("## Planner speed") < text.index("## Executor")
    assert "second\n\n## Executor" in text


def test_cpu_model_and_cases_are_known():
    bench = load_bench()
    assert bench.cpu_model()
    assert bench.BAR_CASE in bench.CASES and bench.CASES[bench.BAR_CASE][:2] == ("deepseek-v3", 1024)
