"""The `data` section: where the prompts come from and how rows are read."""

from __future__ import annotations

from pydantic import Field

from storage.config import Section


class DataConfig(Section):
    prompt_data: str = Field(
        ...,
        description="Training prompts: a .jsonl/.json, .parquet or .arrow file; a directory or "
        "glob of such shards (read in sorted order); a Hugging Face `save_to_disk` directory; "
        "`hf://datasets/org/name[/config]` from the local hub cache. Local or s3:// (through "
        "the storage section's endpoint and options). Read lazily: rows become samples when "
        "drawn.",
    )
    split: str | None = Field(
        None,
        description="Split of a dataset that has several (a DatasetDict directory, a hub "
        "dataset); default: its only split, else 'train'.",
    )
    input_key: str = Field("prompt", description="Column/key holding the prompt.")
    label_key: str | None = Field("label", description="Column/key holding the label.")
    metadata_key: str | None = Field("metadata", description="Column/key with a metadata dict.")
    apply_chat_template: bool = Field(
        False, description="Render prompts through the tokenizer's chat template."
    )
    rollout_max_prompt_len: int | None = Field(
        None, ge=1,
        description="Drop prompts longer than this many tokens (at load time, counted); "
        "default: the model's context minus rollout.max_response_len.",
    )
    shuffle: bool = Field(True, description="Shuffle the dataset at every epoch.")
    seed: int = Field(42, description="Seed of the per-epoch shuffle.")
    preflight_token_rows: int = Field(
        100_000, ge=0,
        description="Rows that the check before step 0 also renders and tokenizes (chat "
        "template, prompt length): every row of a set up to this size, the first rows of a "
        "larger one, whose later rows are rendered when drawn (a too-long prompt is skipped "
        "and counted then; a row the template cannot render fails the step, naming the row). "
        "Every row's fields are checked either way.",
    )
