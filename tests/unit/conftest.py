"""Fixtures shared by the router component tests."""

from tests.unit.test_router_flow import make_router  # noqa: F401  (the scripted-worker router fixture)
