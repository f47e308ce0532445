"""Thin routers: parse, authorise, call one use case of api.service, shape the answer; no queries here."""
