"""The local launcher: a config becomes supervised vLLM worker processes plus the router."""
