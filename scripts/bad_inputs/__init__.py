"""The pieces of `scripts/probe_bad_inputs.py`: the probe's temp workspace and valid task
(`workspace`), and the bad-input cases (`cases`)."""
