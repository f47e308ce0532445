"""Thin routers: parse, authorise, call api.service.jobs / db, shape the answer."""
