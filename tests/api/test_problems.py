"""Domain errors of the use cases and the problems the HTTP layer answers them with."""

from api.http.problems import problem_of
from api.service.errors import Conflict, NotFound, RuleViolation
from spec.errors import FoldtuneError


def test_domain_errors_map_to_problems():
    p = problem_of(NotFound("job 3 does not exist"))
    assert (p.status, p.kind, p.title, p.detail) == (404, "not-found", "Not found", "job 3 does not exist")
    p = problem_of(Conflict("job-finished", "Job already finished", "job 3 already succeeded"))
    assert (p.status, p.kind, p.title, p.detail) == (409, "job-finished", "Job already finished",
                                                     "job 3 already succeeded")
    p = problem_of(RuleViolation("body.model", "known_model", "unknown model 'x'"))
    assert (p.status, p.kind) == (422, "validation")
    assert [(r.loc, r.rule, r.message) for r in p.errors] == [("body.model", "known_model", "unknown model 'x'")]


def test_domain_errors_read_as_one_cli_line():
    error = RuleViolation("body.model", "known_model", "unknown model 'x'")
    assert isinstance(error, FoldtuneError)  # `foldtune` prints it as one error line
    assert str(error) == "body.model: unknown model 'x' [known_model]"
