"""The sections of multi-turn episodes: the environment (its tools, a sandbox, an OpenEnv server), the agent, and
the OpenAI-compatible gateway agents call."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from common.config.base import Section


class SandboxSection(Section):
    """Where a tool runs a model's Python code (``services/environment/sandbox.py``)."""

    isolation: Literal["auto", "bwrap", "rlimits"] = Field(
        "auto",
        description="bwrap: namespaces (no network, read-only file system outside the scratch folder, no host "
        "process visible); rlimits: resource limits and a Python audit hook only (escapable: for trusted code); auto: "
        "bwrap, and where it is not installed or cannot make its namespaces the service refuses to start, saying why "
        "(never rlimits unasked).",
    )
    python: str | None = Field(
        None, description="The interpreter that runs the code; default /usr/bin/python3 where it exists."
    )
    cpu_seconds: float = Field(2.0, gt=0, description="CPU time per run (RLIMIT_CPU).")
    wall_seconds: float = Field(5.0, gt=0, description="Wall-clock time per run; then every process of it is killed.")
    memory_mb: int = Field(512, ge=32, description="Address space per process (RLIMIT_AS).")
    output_bytes: int = Field(
        8192, gt=0, description="Output kept, and the most any file the code writes may hold (RLIMIT_FSIZE)."
    )
    processes: int = Field(
        16,
        gt=0,
        description="Processes one run may have at once (RLIMIT_NPROC of a user of the run's own: applied where the "
        "service runs as root, which can give each run its own unprivileged user).",
    )


class OpenEnvSection(Section):
    """An OpenEnv environment (``openenv-core``) run in process, each episode its own instance
    (``services/environment/adapters.py``)."""

    environment: str = Field(
        description="'module:Class': an OpenEnv environment (a subclass of openenv.core.env_server.interfaces"
        ".Environment)."
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Arguments its constructor is called with.")
    action: str | None = Field(
        None,
        description="'module:Class': its action type (an openenv Action); default: the annotation of its step's "
        "action, or its generic argument.",
    )
    action_field: str | None = Field(
        None, description="The action's field the model's turn (its text) fills; default: its only string field."
    )
    action_parser: str | None = Field(
        None,
        description="'module:function' making the action from the turn's text, for actions that are more than text "
        "(instead of action and action_field).",
    )
    observation_field: str | None = Field(
        None,
        description="The observation's field the model reads; default: its one field besides done, reward and "
        "metadata where that is a string, else those fields as JSON.",
    )
    observation_format: str = Field(
        "\n{observation}\n", description="How the observation's text is set in the episode ({observation})."
    )
    stop: list[str] = Field(
        default_factory=list, description="Strings that end a model turn besides EOS (kept in the turn's text)."
    )

    @model_validator(mode="after")
    def _one_way_to_act(self):
        if self.action_parser is not None and (self.action is not None or self.action_field is not None):
            raise ValueError("set action_parser, or action/action_field, not both")
        if "{observation}" not in self.observation_format:
            raise ValueError("observation_format must hold {observation}")
        return self


OPENENV_ADAPTER = "services.environment.adapters:OpenEnvEnvironment"


class EnvironmentSection(Section):
    """Multi-turn episodes: what the model talks to between its turns (``services/environment/``)."""

    name: str = Field(
        "services.environment.tools:ToolEnvironment",
        description="The environment class, 'module:Class' (a services.environment.base.Environment); the default "
        "serves the built-in tools.",
    )
    tools: list[str] = Field(
        default_factory=lambda: ["calculator"], description="The built-in tools the default environment serves."
    )
    max_turns: int = Field(4, gt=0, description="The model's turns per episode at most; then it ends truncated.")
    max_episode_tokens: int | None = Field(
        None,
        gt=0,
        description="Response tokens per episode at most, the model's and the environment's (default: "
        "max_turns × generation.max_new_tokens); an episode that reaches it ends truncated.",
    )
    turn_timeout_s: float = Field(
        30.0, gt=0, description="How long an environment may take to answer a turn; then the episode ends truncated."
    )
    timeout_reward: float = Field(0.0, description="The environment's reward for an episode ended by a timeout.")
    placement: Literal["bus", "local"] = Field(
        "bus",
        description="bus: environment replicas (streamppo environment) answer the turns over the turns and "
        "observations topics; local: the generator steps the environments in threads of its own process.",
    )
    workers: int = Field(4, gt=0, description="With placement local: environment steps run at once (threads).")
    sandbox: SandboxSection = SandboxSection()
    openenv: OpenEnvSection | None = Field(
        None, description=f"An OpenEnv environment to serve (environment.name is then {OPENENV_ADAPTER})."
    )

    @model_validator(mode="before")
    @classmethod
    def _openenv_names_its_adapter(cls, data):
        if isinstance(data, dict) and data.get("openenv") is not None and "name" not in data:
            data = {**data, "name": OPENENV_ADAPTER}
        return data

    @model_validator(mode="after")
    def _openenv_fits(self):
        if self.openenv is not None and self.name != OPENENV_ADAPTER:
            raise ValueError(f"environment.openenv is read by {OPENENV_ADAPTER} alone; environment.name is {self.name}")
        if self.openenv is None and self.name == OPENENV_ADAPTER:
            raise ValueError(f"environment.name {OPENENV_ADAPTER} needs environment.openenv")
        if self.openenv is not None and "tools" in self.model_fields_set:
            raise ValueError("environment.tools configures the built-in tools; an OpenEnv environment brings its own")
        return self


class AgentSection(Section):
    """The agent that runs each episode of a gateway run (``services/gateway/agents.py``): a function of yours."""

    function: str | None = Field(
        None,
        description="'module:function' called with each episode (services.gateway.agents.Episode: its base_url, "
        "api_key, prompt and label); it talks to the model through any OpenAI client at the episode's base URL. A "
        "number it returns is the episode's reward; None leaves the reward to what it posted, or to "
        "gateway.unrewarded. Required with placement local; with remote, `streamppo agents` takes it (or --function).",
    )
    workers: int = Field(8, gt=0, description="Episodes run at once (threads).")
    placement: Literal["local", "remote"] = Field(
        "local",
        description="local: threads of each gateway replica run the episodes it hands out; remote: nothing in the run "
        "starts agents: `streamppo agents` (or any client of POST /episodes/claim) runs them elsewhere.",
    )

    @model_validator(mode="after")
    def _a_local_agent_is_named(self) -> AgentSection:
        if self.placement == "local" and not self.function:
            raise ValueError("gateway.agent.function is required with placement local (the gateway runs the agent)")
        return self


class GatewaySection(Section):
    """An OpenAI-compatible gateway (``services/gateway/``): agents written for any OpenAI client run each episode,
    and every call they make is sampled by the generator fleet and written to the log before it is answered."""

    host: str = Field("127.0.0.1", description="The address the gateway's HTTP server binds.")
    port: str = Field(
        "8400-8431",
        pattern=r"^\d+(-\d+)?$",
        description="A port, or a range FIRST-LAST: each replica serves on the first free one (0: any free port).",
    )
    public_url: str | None = Field(
        None, description="The URL agents reach a replica at, which base URLs are made of; default http://HOST:PORT."
    )
    model_name: str | None = Field(
        None, description="The model's name in /v1/models and in answers; default: the actor folder's name."
    )
    call_timeout_s: float = Field(
        600.0,
        gt=0,
        description="A client that has waited this long for a call's answer gets a retryable error (503 with "
        "Retry-After; OpenAI's clients time out at 600 s); the call goes on, and the client's retry gets its answer.",
    )
    episode_timeout_s: float = Field(
        300.0, gt=0, description="An episode with no call, reward or end for this long ends (outcome timed_out)."
    )
    unrewarded: Literal["dead_letter", "score", "reward"] = Field(
        "dead_letter",
        description="What becomes of an episode that ends without a reward posted (the agent ended it without one, "
        "failed, or it timed out): dead_letter: not trained, its rows written to episodes.dlq; score: trained on the "
        "run's reward section's score alone (a verifiable reward on the answer); reward: trained with "
        "unrewarded_reward as what the agent would have posted. Each is counted by outcome.",
    )
    unrewarded_reward: float = Field(0.0, description="With unrewarded: reward, the reward such an episode gets.")
    max_calls: int = Field(64, gt=0, description="Calls per episode at most; one more is refused (400).")
    max_episode_tokens: int = Field(
        4096,
        gt=0,
        description="Tokens of an episode's row after its first prompt at most (the model's and the conversation's); "
        "a call whose prompt and max_tokens would pass it is refused (400, context_length_exceeded).",
    )
    max_request_bytes: int = Field(1 << 20, gt=0, description="The largest request body accepted (413 past it).")
    agent: AgentSection | None = Field(
        None,
        description="The agent the run starts for each episode; none: agents "
        "claim episodes over HTTP (POST /episodes/claim).",
    )

    @field_validator("port", mode="before")
    @classmethod
    def _port_as_text(cls, port):
        return str(port) if isinstance(port, int) and not isinstance(port, bool) else port

    @model_validator(mode="after")
    def _reward_only_for_reward(self):
        if "unrewarded_reward" in self.model_fields_set and self.unrewarded != "reward":
            raise ValueError("gateway.unrewarded_reward is read only with gateway.unrewarded: reward")
        return self
