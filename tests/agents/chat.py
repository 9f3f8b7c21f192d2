"""Agents for the gateway's tests, written as a user writes one: the `openai` package, a loop of its own. The tests
name them by file (tests/agents/chat.py:two_turns)."""

from openai import OpenAI


def _client(episode) -> OpenAI:
    # Many retries: the tests kill gateways and generators under these agents.
    return OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=30, timeout=120)


def two_turns(episode):
    """Asks, then asks again after the answer (the chat goes on): the vowels of the second answer are its reward."""
    client = _client(episode)
    messages = [{"role": "user", "content": episode.prompt}]
    first = client.chat.completions.create(model=episode.model, messages=messages, max_tokens=6)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "and then"},
    ]
    second = client.chat.completions.create(model=episode.model, messages=messages, max_tokens=6)
    text = second.choices[0].message.content
    return sum(c in "aeiou" for c in text) / max(1, len(text))


def three_turns_streamed(episode):
    """Three turns with stream=True, then leaves the reward to the run's reward section (returns None)."""
    client = _client(episode)
    messages = [{"role": "user", "content": episode.prompt}]
    for _ in range(3):
        stream = client.chat.completions.create(model=episode.model, messages=messages, max_tokens=5, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
    return None


def edits_history(episode):
    """Asks twice, but rewrites its first answer before the second call: the episode splits into two rows."""
    client = _client(episode)
    messages = [{"role": "user", "content": episode.prompt}]
    first = client.chat.completions.create(model=episode.model, messages=messages, max_tokens=4)
    edited = "edited " + first.choices[0].message.content
    messages += [{"role": "assistant", "content": edited}, {"role": "user", "content": "go on"}]
    client.chat.completions.create(model=episode.model, messages=messages, max_tokens=4)
    return 0.5


def two_turns_counting(episode):
    """two_turns, writing how many retries each call took (AGENT_LOG, a line per call, as it returns) and which calls
    are in flight (a file each in AGENT_IN_FLIGHT while it is): the tests that kill a gateway or a generator under it
    kill while a call is in flight, and see that it was cut short and retried."""
    import json
    import os
    from pathlib import Path

    client = _client(episode)
    messages = [{"role": "user", "content": episode.prompt}]
    for turn, follow_up in enumerate(("and then", None)):
        in_flight = Path(os.environ["AGENT_IN_FLIGHT"]) / f"{episode.id.replace('/', '-')}-{turn}"
        in_flight.touch()
        try:
            raw = client.chat.completions.with_raw_response.create(
                model=episode.model, messages=messages, max_tokens=24
            )
        finally:
            in_flight.unlink()
        with open(os.environ["AGENT_LOG"], "a") as log:
            log.write(json.dumps({"episode": episode.id, "turn": turn, "retries": raw.retries_taken}) + "\n")
        text = raw.parse().choices[0].message.content
        if follow_up:
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": follow_up}]
    return sum(c in "aeiou" for c in text) / max(1, len(text))


def calls_logged(episode):
    """Four calls of a chat that goes on, each answer's call id written to AGENT_LOG (benchmarks/gateway.py kills):
    every answer a client got is then looked up on the episodes log."""
    import json
    import os

    client = _client(episode)
    messages, calls = [{"role": "user", "content": episode.prompt}], []
    for _ in range(4):
        answer = client.chat.completions.create(model=episode.model, messages=messages, max_tokens=12)
        calls.append(answer.id.removeprefix("call-"))
        messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                     {"role": "user", "content": "go on"}]  # fmt: skip
    with open(os.environ["AGENT_LOG"], "a") as log:
        log.write(json.dumps({"episode": episode.id, "calls": calls}) + "\n")
    return 0.5


def langchain_two_turns(episode):
    """two_turns as a LangChain user writes it: ChatOpenAI pointed at the episode's base URL, its own message types."""
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=episode.base_url, api_key=episode.api_key, model=episode.model, max_tokens=6, max_retries=30
    )
    history = [HumanMessage(episode.prompt)]
    history += [llm.invoke(history), HumanMessage("and then")]
    text = llm.invoke(history).content
    return sum(c in "aeiou" for c in text) / max(1, len(text))
