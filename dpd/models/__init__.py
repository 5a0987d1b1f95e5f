"""Models dpd serves: the bundled SmolLM2, local directories, hub ids."""
