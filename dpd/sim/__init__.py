"""A discrete-event simulator of an endpoint that drives the router's own decision code."""
