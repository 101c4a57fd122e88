"""Prompt data: prompt files and datasets, row checks, and the data source with its buffer
(what `sample_prompts` hands out, checkpointed per step)."""
