"""The HTTP front end: FastAPI app, routes, dependencies, and the mapping of domain errors to RFC 9457 problems."""
