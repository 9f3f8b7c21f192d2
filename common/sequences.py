"""Prompt + response sequences as the models see them, and the forward passes every role shares.

On the wire, prompts and responses are separate right-padded arrays. For a forward pass they are packed as
``[left-padded prompt | right-padded response]`` so that response token ``t`` of every row sits at sequence
position ``P + t``; the logits (and critic outputs) at ``P + t − 1`` are the ones that belong to it.
Position ids are computed from the attention mask, so left padding does not shift positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.ppo import entropy_from_logits, logprobs_from_logits

__all__ = [
    "PackedSequences",
    "batched_response_logprobs",
    "batched_response_values",
    "lengths_to_mask",
    "micro_batches",
    "microbatch_view",
    "pack",
    "pad_columns",
    "response_logprobs",
    "response_values",
]


def lengths_to_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``(B,)`` lengths -> ``(B, width)`` float mask, 1.0 on the first ``length`` positions of each row."""
    return (torch.arange(width, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)).float()


@dataclass(frozen=True)
class PackedSequences:
    input_ids: torch.Tensor  # (B, P + T)
    attention_mask: torch.Tensor  # (B, P + T)
    position_ids: torch.Tensor  # (B, P + T)
    prompt_width: int  # P
    response_width: int  # T

    def rows(self, index: torch.Tensor | slice) -> PackedSequences:
        return PackedSequences(
            self.input_ids[index],
            self.attention_mask[index],
            self.position_ids[index],
            self.prompt_width,
            self.response_width,
        )

    def trimmed(self, prompt_width: int, response_width: int) -> PackedSequences:
        """The same rows without the padding columns beyond the given widths (left of the prompts, right of the
        responses): what a micro-batch of short rows needs to compute, and nothing more."""
        start = self.prompt_width - prompt_width
        stop = self.prompt_width + response_width
        return PackedSequences(
            self.input_ids[:, start:stop],
            self.attention_mask[:, start:stop],
            self.position_ids[:, start:stop],
            prompt_width,
            response_width,
        )


def micro_batches(
    prompt_lengths: torch.Tensor,
    response_lengths: torch.Tensor,
    rows: torch.Tensor,
    max_tokens: int | None = None,
    max_rows: int | None = None,
) -> list[torch.Tensor]:
    """Split ``rows`` (indices into the ``(B,)`` length tensors) into the groups of one forward pass each.

    With ``max_tokens``, rows are sorted by length (prompt + response, longest first) and grouped while
    ``rows × longest row`` fits the budget, so that a batch of long sequences never needs one giant pass and short
    rows do not pay for long ones' padding; a row longer than the budget goes alone. Otherwise the rows are cut, in
    their order, into groups of ``max_rows`` (all of them if None).
    """
    if max_tokens is None:
        size = max_rows or max(len(rows), 1)
        return [rows[i : i + size] for i in range(0, len(rows), size)]
    lengths = (prompt_lengths + response_lengths)[rows]
    order = torch.argsort(lengths, descending=True, stable=True)
    groups: list[list[int]] = []
    longest = 0
    for position in order.tolist():
        length = int(lengths[position])
        if groups and (len(groups[-1]) + 1) * max(longest, length) <= max_tokens:
            groups[-1].append(position)
            longest = max(longest, length)
        else:
            groups.append([position])
            longest = length
    return [rows[torch.tensor(group, dtype=torch.long)] for group in groups]


def microbatch_view(
    packed: PackedSequences, prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, rows: torch.Tensor
) -> PackedSequences:
    """``packed.rows(rows)`` trimmed to the longest prompt and the longest response among them."""
    prompt_width = max(int(prompt_lengths[rows].max()), 1)
    response_width = max(int(response_lengths[rows].max()), 1)
    return packed.rows(rows).trimmed(min(prompt_width, packed.prompt_width), min(response_width, packed.response_width))


def pad_columns(values: torch.Tensor, width: int) -> torch.Tensor:
    """``(b, t)`` values padded with zeros on the right to ``(b, width)``."""
    return torch.nn.functional.pad(values, (0, width - values.shape[1]))


def pack(
    prompt_tokens: torch.Tensor,
    prompt_lengths: torch.Tensor,
    response_tokens: torch.Tensor,
    response_lengths: torch.Tensor,
    pad_token_id: int,
) -> PackedSequences:
    """Pack right-padded prompts ``(B, P)`` and responses ``(B, T)`` into one ``(B, P + T)`` batch."""
    batch, prompt_width = prompt_tokens.shape
    response_width = response_tokens.shape[1]
    prompt_mask = lengths_to_mask(prompt_lengths, prompt_width).long()
    # Right-align each prompt: row b's real tokens move from [0, len) to [P − len, P).
    shift = (prompt_width - prompt_lengths).unsqueeze(1)
    source = (torch.arange(prompt_width).unsqueeze(0) - shift).clamp(min=0)
    left_prompts = torch.where(prompt_mask.flip(1).bool(), prompt_tokens.gather(1, source), pad_token_id)
    left_mask = prompt_mask.flip(1)
    response_mask = lengths_to_mask(response_lengths, response_width).long()
    input_ids = torch.cat([left_prompts, torch.where(response_mask.bool(), response_tokens, pad_token_id)], dim=1)
    attention_mask = torch.cat([left_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return PackedSequences(input_ids, attention_mask, position_ids, prompt_width, response_width)


def _forward(model, packed: PackedSequences, **kwargs):
    """The model on ``packed``, moved to the model's device; outputs stay there."""
    device = model.device
    return model(
        input_ids=packed.input_ids.to(device),
        attention_mask=packed.attention_mask.to(device),
        position_ids=packed.position_ids.to(device),
        use_cache=False,
        **kwargs,
    )


def response_logprobs(
    model, packed: PackedSequences, response_tokens: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``(B, T)`` of the response tokens under a causal LM at sampling temperature (and the entropy).

    Only the ``T + 1`` last positions' logits are computed (``logits_to_keep``): the vocabulary projection of the
    prompt positions is never needed.
    """
    width = packed.response_width
    logits = _forward(model, packed, logits_to_keep=width + 1).logits[:, :-1]
    logits = logits.float() / temperature
    logp = logprobs_from_logits(logits, response_tokens.to(logits.device))
    entropy = entropy_from_logits(logits) if with_entropy else None
    return logp, entropy


def response_values(critic, packed: PackedSequences) -> torch.Tensor:
    """Critic values ``(B, T)``: ``V(s_t)`` is read at the position just before response token ``t``."""
    out = _forward(critic, packed).logits.squeeze(-1).float()
    start = packed.prompt_width - 1
    return out[:, start : start + packed.response_width]


def _in_micro_batches(forward, packed, prompt_lengths, response_lengths, max_tokens, max_rows) -> torch.Tensor:
    """``forward(view, rows) -> (b, t)`` over the micro-batches of every row, put back together as ``(B, T)``."""
    out = None
    rows = torch.arange(len(response_lengths))
    for group in micro_batches(prompt_lengths, response_lengths, rows, max_tokens, max_rows):
        # Trimmed to the group's own widths under a token budget, which is what the budget counts.
        view = microbatch_view(packed, prompt_lengths, response_lengths, group) if max_tokens else packed.rows(group)
        part = forward(view, group)
        if out is None:
            out = torch.zeros((len(rows), packed.response_width), dtype=part.dtype, device=part.device)
        out[group.to(part.device)] = pad_columns(part, packed.response_width)
    return out


def batched_response_logprobs(
    model,
    packed: PackedSequences,
    prompt_lengths: torch.Tensor,
    response_tokens: torch.Tensor,
    response_lengths: torch.Tensor,
    temperature: float = 1.0,
    max_tokens: int | None = None,
    max_rows: int | None = None,
) -> torch.Tensor:
    """:func:`response_logprobs` ``(B, T)`` of every row, in micro-batches (see :func:`micro_batches`)."""

    def forward(view: PackedSequences, rows: torch.Tensor) -> torch.Tensor:
        return response_logprobs(model, view, response_tokens[rows, : view.response_width], temperature)[0]

    return _in_micro_batches(forward, packed, prompt_lengths, response_lengths, max_tokens, max_rows)


def batched_response_values(
    critic,
    packed: PackedSequences,
    prompt_lengths: torch.Tensor,
    response_lengths: torch.Tensor,
    max_tokens: int | None = None,
    max_rows: int | None = None,
) -> torch.Tensor:
    """:func:`response_values` ``(B, T)`` of every row, in micro-batches (see :func:`micro_batches`)."""
    return _in_micro_batches(
        lambda view, rows: response_values(critic, view), packed, prompt_lengths, response_lengths, max_tokens, max_rows
    )
