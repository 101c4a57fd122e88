"""Multi-turn tool calling: a calculator agent as a custom generate function."""
