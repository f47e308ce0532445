import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
