"""Each component's config section (a module per section) and the run config view engines
read (run.py): the bottom of engines/, importing nothing of engines above it."""
