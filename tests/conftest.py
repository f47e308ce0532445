import os

# The suite's Ray instances run without Ray's token authentication: every test process shares one local Ray
# (tests/api/runner_env.py) and the runner subprocesses join it by address. Where the environment does not
# say otherwise; one test turns it on (tests/api/test_runner_sigterm.py: a runner whose own Ray has auth),
# and tests/executor/test_ray_auth.py covers the token file. See docs/deploy.md, "Ray token authentication".
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
