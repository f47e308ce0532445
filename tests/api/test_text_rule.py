"""One text rule for every string a user sends (api.schemas.common.text_problem): NUL, other control
characters and lone surrogates are refused with a 422 naming ``valid_text`` on every body (jobs, plans,
trainings, hardware profiles), in query parameters and in owner names, before the database sees them: on
PostgreSQL a NUL in a profile's ``source`` used to answer 500 and reset the connection (the fixtures run
each test on SQLite and PostgreSQL)."""

import copy
import json

from problem_rules import validation_rules

from api.cli.main import main
from test_catalog import H

RULE = "valid_text"


def _post(client, path, body, headers):
    """POST ``body`` as JSON escapes (ASCII), so lone surrogates reach the server as JSON allows them."""
    return client.post(path, content=json.dumps(body).encode(), headers={**headers, "Content-Type": "application/json"})


def _refused(response):
    rules = {rule for _, rule in validation_rules(response)}
    assert RULE in rules, response.text
    return response.json()


def test_a_profile_source_with_invalid_text_is_refused_and_nothing_stored(client, alice):
    for bad in ("calibrated\x00on h100", "bell\x07", "half \ud800 a pair", "\x1b[31mred"):
        _refused(_post(client, "/v1/hardware-profiles", {**H, "source": bad}, alice))
        assert client.get("/v1/hardware-profiles/my-gpu", headers=alice).status_code == 404
        assert client.get("/healthz").status_code == 200  # the database connection is fine afterwards


def test_free_text_keeps_line_breaks_but_names_do_not(client, alice):
    assert _post(client, "/v1/hardware-profiles", {**H, "source": "measured\r\n\ton h100"}, alice).status_code == 201
    _refused(_post(client, "/v1/hardware-profiles", {**H, "name": "x", "gpu": {**H["gpu"], "name": "a\tb"}}, alice))


CASES = [
    ("/v1/jobs", lambda b: b.update(model="tiny-moe\x00")),
    ("/v1/jobs", lambda b: b["training"].update(precision="bf16\ud800")),
    ("/v1/plans", lambda b: b.update(model="tiny\x01moe")),
    ("/v1/hardware-profiles", lambda b: b.update(component_factors={"tiny-moe@seq64\x00": {"gemm": 1.0}})),
    ("/v1/hardware-profiles", lambda b: b.update(collective_efficiency={"all_reduce:intra": [[1.0, 0.5]],
                                                                        "\udc80": [[1.0, 0.5]]})),
    ("/v1/trainings", lambda b: b.update(layout="tp1 ep2\x00")),
    ("/v1/trainings", lambda b: b.update(checkpoint_dir="ckpt\nrun")),
    ("/v1/trainings", lambda b: b.update(data_path="data\x00")),
]


def test_every_body_refuses_invalid_text(client, alice, job_body, training_body):
    for path, mutate in CASES:
        body = copy.deepcopy({"/v1/jobs": job_body, "/v1/plans": {k: job_body[k] for k in ("model", "training", "cluster")},
                              "/v1/hardware-profiles": H, "/v1/trainings": training_body}[path])
        mutate(body)
        _refused(_post(client, path, body, alice))
    assert client.get("/v1/jobs", headers=alice).json()["total"] == 0  # nothing was stored
    assert client.get("/v1/trainings", headers=alice).json()["total"] == 0
    profiles = client.get("/v1/hardware-profiles", params={"limit": 50}, headers=alice).json()["items"]
    assert all(p["builtin"] for p in profiles)


def test_query_parameters_obey_the_rule(client, alice):
    assert ("query.model", RULE) in validation_rules(client.get("/v1/jobs", params={"model": "a\x00"}, headers=alice))
    assert client.get("/v1/jobs", params={"model": "tiny-moe"}, headers=alice).status_code == 200


def test_owner_names_obey_the_rule(db_url, capsys):
    assert main(["keys", "create", "eve\x00", "--database-url", db_url]) == 2
    assert "control character U+0000" in capsys.readouterr().err
    assert main(["keys", "create", "eve\ud800", "--database-url", db_url]) == 2
