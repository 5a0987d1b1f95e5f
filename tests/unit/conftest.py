"""Fixtures shared by the router component tests."""

import os

# `dpd plan` run as a subprocess by a test runs the source, even where a developer has compiled
# the simulator (`make sim-compiled`); tests/unit/test_sim_compiled.py turns it back on where it means to.
os.environ["DPD_SIM_COMPILED"] = "0"

from tests.unit.test_router_flow import make_router  # noqa: F401  (the scripted-worker router fixture)
