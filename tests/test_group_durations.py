"""The suite's work-unit order (tests/group_durations.py, tests/conftest.py ``_longest_units_first``)."""

from tests import group_durations


def test_report_lines_sum_per_unit_and_skip_other_lines():
    report = [
        "============================= slowest durations =============================",
        "41.00s call     tests/api/test_calibrate_ray.py::test_nic[sqlite]@ray_cluster",
        "13.10s setup    tests/api/test_multinode.py::test_a[sqlite]@ray_cluster",
        "2.50s call     tests/spec/test_layout.py::test_x[tp2 ep2]@tests/spec/test_layout.py",
        "0.01s teardown tests/spec/test_layout.py::test_x[tp2 ep2]@tests/spec/test_layout.py",
        "(12 durations < 0.005s hidden.  Use -vv to show these durations.)",
        "2489 passed, 21 skipped in 1015.03s (0:16:55)",
    ]
    assert group_durations.from_report(report) == {"ray_cluster": 54.1, "tests/spec/test_layout.py": 2.51}


def test_unrecorded_units_count_their_tests_at_the_hidden_durations_bound():
    weights = group_durations.weights({"ray_cluster": 13, "tests/new.py": 200}, {"ray_cluster": 285.0})
    assert weights == {"ray_cluster": 285.0, "tests/new.py": 200 * 0.005}


def test_the_committed_record_names_the_long_units():
    record = group_durations.recorded()
    assert record["ray_cluster"] > 60 and record["tests/executor/test_equivalence.py"] > 60
