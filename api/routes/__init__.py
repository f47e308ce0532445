"""Thin routers: parse, authorise, call api.jobs_service / db, shape the answer."""
