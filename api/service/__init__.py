"""Use cases shared by the HTTP service, the worker and the CLI; they raise domain errors (api.service.errors)."""
