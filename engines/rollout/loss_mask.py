"""Loss masks for multi-turn chat data: train on what the assistant says, nothing else.

The conversation is rendered once with the tokenizer's own chat template and tokenised once,
so the ids are exactly what the model sees at inference; the assistant spans are found as
character ranges by rendering growing prefixes of the conversation:

    render(m[:i], add_generation_prompt=True)   ... "<|im_start|>assistant\\n"   (mask 0)
    render(m[:i+1])                             ... "Sure, 42.<|im_end|>\\n"       (mask 1)

and each token takes the mask of the character it starts at (fast-tokenizer offsets). The
end-of-turn marker after an assistant message is trained too, so the model learns to stop.
This needs a template whose rendering of a prefix is a prefix of the full rendering; one that
rewrites earlier turns (e.g. drops past reasoning) is rejected with the message index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Messages = Sequence[dict[str, Any]]


class LossMaskError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class MaskedConversation:
    token_ids: list[int]
    loss_mask: list[int]  # same length as token_ids

    @property
    def response_start(self) -> int:
        """Index of the first trained token: everything before it is the prompt."""
        return self.loss_mask.index(1) if 1 in self.loss_mask else len(self.loss_mask)


def _render(tokenizer: Any, messages: Messages, generation_prompt: bool, tools: Any) -> str:
    if not messages:
        return ""
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": generation_prompt}
    if tools is not None:
        kwargs["tools"] = tools
    return str(tokenizer.apply_chat_template(list(messages), **kwargs))


def trained_char_spans(
    tokenizer: Any,
    messages: Messages,
    train_roles: Sequence[str] = ("assistant",),
    tools: Any = None,
) -> tuple[str, list[tuple[int, int]]]:
    """The full rendered text and the [start, end) character spans of trained messages."""
    full = _render(tokenizer, messages, False, tools)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message.get("role") not in train_roles:
            continue
        # an assistant turn's header is the generation prompt; other trained roles have no
        # such marker, so their span includes their header
        head = _render(tokenizer, messages[:i], message.get("role") == "assistant", tools)
        upto = _render(tokenizer, messages[: i + 1], False, tools)
        if not (full.startswith(upto) and upto.startswith(head)):
            raise LossMaskError(
                f"message {i}: the chat template does not render this conversation's prefixes "
                "as prefixes of the whole (it rewrites earlier turns), so assistant spans "
                "cannot be located"
            )
        spans.append((len(head), len(upto)))
    return full, spans


def mask_from_offsets(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for each token whose first character lies inside a span."""
    return [int(any(a <= start < b for a, b in spans)) for start, _ in offsets]


def chat_loss_mask(
    tokenizer: Any,
    messages: Messages,
    train_roles: Sequence[str] = ("assistant",),
    tools: Any = None,
) -> MaskedConversation:
    """Token ids of the whole conversation and a 0/1 mask, 1 only on `train_roles` turns."""
    if not messages:
        raise LossMaskError("empty conversation")
    full, spans = trained_char_spans(tokenizer, messages, train_roles, tools)
    if not getattr(tokenizer, "is_fast", False):
        raise LossMaskError("the loss-mask generator needs a fast tokenizer (char offsets)")
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    return MaskedConversation(ids, mask_from_offsets(enc["offset_mapping"], spans))
