"""The broadcast path for actor weights: real gloo groups over real sockets, a receiver that dies, and the fallback.

Sender and receivers here are the classes the learner and the generator use; a receiver that must die for real runs
in a subprocess and is killed with SIGKILL.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO

from common.broadcast import WeightReceiver, WeightSender, split_address
from common.models import load_actor
from common.weights import WeightIntegrityError, load_state_into, snapshot_state
from services.transport.brokers.local_broker import free_port

pytestmark = pytest.mark.slow  # gloo groups and their timeouts


TIMEOUT_S = 5.0


def free_address() -> str:
    return f"127.0.0.1:{free_port()}"


def state_of(model, shift: float) -> dict[str, torch.Tensor]:
    return {k: (v + shift).to(v.dtype) for k, v in snapshot_state(model).items()}


def until(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {seconds} s: {what}")


def send_when_formed(sender: WeightSender, version: int, state) -> str:
    until(lambda: not sender.waiting_for(), 4 * TIMEOUT_S, "the broadcast group forms")
    return sender.send(version, state)


@pytest.fixture
def sender():
    made = []

    def make(receivers: int = 1, address: str | None = None) -> WeightSender:
        made.append(WeightSender(address or free_address(), receivers, TIMEOUT_S, "blake3"))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_a_version_broadcast_is_loaded_only_under_its_version_and_digest(tiny_model, sender):
    model, target = load_actor(tiny_model), load_actor(tiny_model)
    s = sender(receivers=2)
    first, second = (WeightReceiver(s.address, TIMEOUT_S, "blake3", name=f"gen-{i}") for i in range(2))
    try:
        state = state_of(model, 0.5)
        digest = send_when_formed(s, 3, state)
        assert digest.startswith("blake3:")
        assert first.received == second.received == 1  # the send returns once every receiver holds it
        assert not first.load_into(2, digest, lambda t: load_state_into(target, t, "broadcast"))  # another version
        assert not first.load_into(3, "blake3:" + "0" * 64, lambda t: load_state_into(target, t, "broadcast"))
        assert not torch.equal(target.model.embed_tokens.weight, state["model.embed_tokens.weight"])
        assert first.load_into(3, digest, lambda t: load_state_into(target, t, "broadcast"))
        for name, tensor in state.items():
            assert torch.equal(target.state_dict()[name], tensor), name
        # The next version reuses the buffers; its digest differs, and what arrives is the new state.
        bf16 = {k: v.to(torch.bfloat16) for k, v in state_of(model, -0.25).items()}
        again = s.send(4, bf16)
        assert again and again != digest
        into = load_actor(tiny_model, "bfloat16")
        assert second.load_into(4, again, lambda t: load_state_into(into, t, "broadcast"))
        assert all(torch.equal(into.state_dict()[k], v) for k, v in bf16.items())
    finally:
        first.close()
        second.close()


def test_tensors_that_do_not_fit_the_model_are_refused_untouched(tiny_model, sender):
    model, target = load_actor(tiny_model), load_actor(tiny_model)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    s = sender()
    receiver = WeightReceiver(s.address, TIMEOUT_S, "blake3")
    try:
        state = state_of(model, 1.0)
        state.pop("model.norm.weight")
        digest = send_when_formed(s, 1, state)
        with pytest.raises(WeightIntegrityError, match="missing \\['model.norm.weight'\\]"):
            receiver.load_into(1, digest, lambda t: load_state_into(target, t, "broadcast of v1"))
        assert all(torch.equal(target.state_dict()[k], v) for k, v in before.items())
    finally:
        receiver.close()


def test_without_all_its_receivers_the_learner_sends_nothing_and_says_who_is_missing(tiny_model, sender):
    s = sender(receivers=2)
    receiver = WeightReceiver(s.address, TIMEOUT_S, "blake3")
    state = state_of(load_actor(tiny_model), 0.0)
    try:
        until(lambda: s.waiting_for().startswith("1 of 2"), 2 * TIMEOUT_S, "one receiver has joined")
        started = time.monotonic()
        assert s.send(1, state) == ""
        # The first version waits for the group, once, as long as a broadcast step may take.
        assert TIMEOUT_S - 0.5 <= time.monotonic() - started <= TIMEOUT_S + 1.0
        started = time.monotonic()
        assert s.send(2, state) == ""
        assert time.monotonic() - started < 0.5  # later ones go by the store at once
        assert receiver.received == 0
    finally:
        receiver.close()


RECEIVER = """
import sys, time
from common.broadcast import WeightReceiver
receiver = WeightReceiver(sys.argv[1], float(sys.argv[2]), "blake3", name="doomed")
while receiver.received < 1:
    time.sleep(0.01)
print("received", flush=True)
time.sleep(3600)
"""


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["dead", "hung"])
def test_a_receiver_lost_costs_one_fallback_and_a_new_group_forms_without_it(tiny_model, sender, fault):
    model = load_actor(tiny_model)
    s = sender(receivers=1)
    doomed = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, s.address, str(TIMEOUT_S)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    replacement = None
    try:
        assert send_when_formed(s, 1, state_of(model, 0.1))
        assert doomed.stdout.readline().strip() == "received"
        doomed.send_signal(fault)
        started = time.monotonic()
        assert s.send(2, state_of(model, 0.2)) == ""  # gone or hung: the store carries v2
        assert time.monotonic() - started <= TIMEOUT_S + 1.0  # a hung one costs the timeout, once
        replacement = WeightReceiver(s.address, TIMEOUT_S, "blake3", name="replacement")
        digest = send_when_formed(s, 3, state_of(model, 0.3))
        assert digest and replacement.received == 1
        target = load_actor(tiny_model)
        assert replacement.load_into(3, digest, lambda t: load_state_into(target, t, "broadcast"))
        assert torch.equal(target.model.norm.weight, state_of(model, 0.3)["model.norm.weight"])
    finally:
        doomed.kill()
        if replacement is not None:
            replacement.close()


def test_a_learner_that_cannot_listen_says_where():
    address = free_address()
    host, port = split_address(address)
    with socket.socket() as taken:
        taken.bind((host, port))
        taken.listen()
        with pytest.raises(RuntimeError, match=f"weights.broadcast.address {address}: cannot listen there"):
            WeightSender(address, 1, TIMEOUT_S, "blake3")
    for bad in ("localhost", "host:port", ":29500", "host:70000"):
        with pytest.raises(ValueError, match="is not HOST:PORT"):
            split_address(bad)


EXITS = """
import sys, torch
from common.broadcast import WeightReceiver, WeightSender
sender = WeightSender(sys.argv[1], 1, 5.0, "blake3")
receiver = WeightReceiver(sys.argv[1], 5.0, "blake3")
assert sender.send(1, {"w": torch.ones(8)})
print("sent", flush=True)
"""


def test_a_process_that_broadcasts_exits_cleanly_without_closing_anything():
    """The threads wait inside torch's C++ code; left there at exit they abort the process (a learner that ends
    its run would then be restarted by its launcher, again and again)."""
    result = subprocess.run(
        [sys.executable, "-c", EXITS, free_address()],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.stdout == "sent\n" and result.returncode == 0, result.stderr[-2000:]
