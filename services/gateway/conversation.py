"""From an agent's request to the prompt's token ids, reusing the episode's tokens exactly.

A call *extends* an earlier call of its episode when its prompt, as text, begins with that call's prompt and answer as
the client read them (a chat is rendered with the model's chat template first; and a chat's message after that call's
messages is that answer, as the assistant's, word for word). The earlier call's prompt tokens and
sampled tokens are then taken as they are, and only the rest of the text is tokenized: the model's own tokens are never
re-tokenised, and each call tokenizes only what is new, however long the episode (re-tokenising the whole chat at every
turn costs more with every turn, and may split the model's words differently than it sampled them).

What the model sampled may hold more than the client read: the end-of-turn token (EOS), or the stop string that ended
its turn (an OpenAI answer leaves both out). Where the text that follows the answer begins with the special token the
model's turn ended with (a chat template writes the end-of-turn token after each assistant message), that token is the
model's own already and is not tokenized again; otherwise the model's tokens stay as sampled (a stop string
included) and the rest follows them.

A prompt that extends no earlier call (the client edited or dropped a message, or a chat template that renders earlier
turns differently once more follow: it is not append-only) begins a new row of the episode: its whole text is tokenized.
:func:`append_only_violation` says at start whether the chat template is append-only.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CallView", "Prompt", "Prompts", "append_only_violation", "render_chat"]


@dataclass(frozen=True)
class CallView:
    """What a prompt needs of an earlier call of the episode."""

    id: str
    prompt_text: str  # the whole prompt as the client sent it (a chat: rendered)
    prompt_tokens: tuple[int, ...]  # the whole prompt's token ids
    response_tokens: tuple[int, ...]  # what the model sampled
    text: str  # the answer as the client read it
    written: str  # what the model wrote: its tokens decoded without special tokens (a stop string included)
    sampled_end: str  # the special token the model's turn ended with (EOS), as text; '' when it ended otherwise
    row_start: int  # the prompt tokens of its row (its first call's): its tokens past them are the row's response
    messages: int = 0  # a chat's messages (0: a prompt of the completions API)

    @property
    def context(self) -> str:
        """The prompt and the answer, as the client read them: what a call that extends this one begins with."""
        return self.prompt_text + self.text

    def answers(self) -> tuple[str, ...]:
        """The answer as a client may send it back: as it read it, or as the model wrote it (a client that puts back
        the stop string its answer was cut at)."""
        return (self.text, self.written) if self.written != self.text else (self.text,)


@dataclass(frozen=True)
class Prompt:
    parent: str  # the call extended ('' when none: the prompt begins a new row)
    text: str  # the prompt's text after the parent's answer as the client read it (the whole prompt without a parent)
    new_tokens: tuple[int, ...]  # the token ids of what is new (the whole prompt without a parent)
    tokens: tuple[int, ...]  # the whole prompt: the parent's prompt and sampled tokens, then the new ones
    full_text: str  # the whole prompt as the client sent it
    row_start: int  # the prompt tokens of the row it belongs to (its own without a parent)


class Prompts:
    """Builds prompts for one model's tokenizer (and chat template)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def chat(self, messages: list[dict], earlier: list[CallView], tools: list | None = None) -> Prompt:
        """The prompt of a chat call: ``messages`` rendered with the chat template (the assistant's turn begun)."""

        def answered(call: CallView) -> bool:  # the chat goes on from the call's answer, as the client read it
            if not 0 < call.messages < len(messages):
                return False
            reply = messages[call.messages]
            return reply.get("role") == "assistant" and reply.get("content") in call.answers()

        candidates = [call for call in earlier if answered(call)]
        return self.text(render_chat(self.tokenizer, messages, tools), candidates, special_tokens=False)

    def text(self, prompt: str, earlier: list[CallView], special_tokens: bool = True) -> Prompt:
        """The prompt of a call whose prompt is ``prompt`` (``special_tokens``: the tokenizer adds its own, e.g. BOS,
        to a prompt that extends nothing, as the completions API does; a rendered chat has them already)."""
        parent, answer = _extended(prompt, earlier)
        if parent is None:
            tokens = tuple(self.tokenizer(prompt, add_special_tokens=special_tokens).input_ids)
            return Prompt("", prompt, tokens, tokens, prompt, len(tokens))
        rest = prompt[len(parent.prompt_text) + len(answer) :]
        new = self._tokenize(_after_sampled(rest, parent))
        whole = parent.prompt_tokens + parent.response_tokens + new
        return Prompt(parent.id, prompt[len(parent.context) :], new, whole, prompt, parent.row_start)

    def tokens(self, prompt: list[int], earlier: list[CallView]) -> Prompt:
        """The prompt of a call that sends token ids (the completions API): an earlier call's tokens are extended
        when they are its beginning."""
        ids = tuple(prompt)
        for call in sorted(earlier, key=lambda call: -len(call.prompt_tokens) - len(call.response_tokens)):
            context = call.prompt_tokens + call.response_tokens
            if ids[: len(context)] == context:
                new = ids[len(context) :]
                text = self.tokenizer.decode(ids)
                return Prompt(call.id, self.tokenizer.decode(new), new, ids, text, call.row_start)
        return Prompt("", self.tokenizer.decode(ids), ids, ids, self.tokenizer.decode(ids), len(ids))

    def _tokenize(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer(text, add_special_tokens=False).input_ids) if text else ()


def _extended(prompt: str, earlier: list[CallView]) -> tuple[CallView | None, str]:
    """The earlier call whose prompt and answer (either form, :meth:`CallView.answers`) ``prompt`` begins with, the
    longest such, and that answer; ``(None, "")`` when there is none."""
    candidates = sorted(
        ((call, answer) for call in earlier for answer in call.answers()),
        key=lambda pair: len(pair[0].prompt_text) + len(pair[1]),
        reverse=True,
    )
    for call, answer in candidates:  # the newest call is the longest and, in a chat that goes on, the one: one check
        if prompt.startswith(call.prompt_text) and prompt.startswith(answer, len(call.prompt_text)):
            return call, answer
    return None, ""


def _after_sampled(rest: str, parent: CallView) -> str:
    """``rest`` (what follows the parent's answer) less the special token the model's turn ended with, where it
    begins with it: the end-of-turn token a chat template writes after the answer is the model's own, in its tokens."""
    end = parent.sampled_end
    return rest[len(end) :] if end and rest.startswith(end) else rest


def render_chat(tokenizer, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True) -> str:
    """``messages`` as the model reads them: rendered with its chat template; raises ValueError without one."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template: send the prompt as text to /v1/completions")
    return tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=False
    )


# Conversations that an agent's calls make: an earlier turn followed by more. A template that renders the earlier
# turns of one differently once more follow (e.g. drops an earlier answer's reasoning) is not append-only.
_PROBES = (
    [{"role": "user", "content": "what is one and one"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is one and one"}],
)
_ANSWER, _NEXT = "two", {"role": "user", "content": "and two more"}


def append_only_violation(tokenizer) -> str | None:
    """Why the chat template is not append-only (a call that continues a chat would begin a new row), or None when
    it is, or when there is no template (chats are refused then)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    for messages in _PROBES:
        try:
            before = render_chat(tokenizer, messages)
            after = render_chat(tokenizer, [*messages, {"role": "assistant", "content": _ANSWER}, _NEXT])
        except Exception as exc:  # a template that refuses such a chat (e.g. one that needs a system message)
            return f"the chat template cannot render a conversation of {[m['role'] for m in messages]}: {exc}"
        if not after.startswith(before + _ANSWER):
            return (
                "the chat template renders an earlier turn differently once the conversation goes on "
                f"({before + _ANSWER!r} is not the beginning of {after!r}): every call after the first begins a new row"
            )
    return None
