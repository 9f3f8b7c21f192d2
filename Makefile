# streamppo's steps, each runnable alone. `make ci` is the README's test command and all that .ci/run calls.
#
#   make setup       what the tests need: Debian's bubblewrap, Java and Maven where missing (as root), the venv
#                    (deploy/install.py: the inference engine this machine takes, every pin from pyproject.toml),
#                    Apache Kafka's jars from Maven Central (deploy/kafka/pom.xml, once, into ~/.cache/streamppo)
#   make run         the README's first run: the venv without the test extras, then the vowels example
#   make lint        ruff, as configured in pyproject.toml
#   make test-fast   the fast tier: no processes, no engine, no broker (docs/testing.md)
#   make test        every test but the soak runs and the recipes' quick modes, with a Docker engine for the
#                    container tests, stopped again whatever happens
#   make test-soak   the long runs of processes (chaos kill -9s, three brokers, the compose fleet, ...: the list is in
#                    docs/testing.md), with a Docker engine as in `make test`
#   make test-recipes   every recipe's quick mode (examples/*/run.sh --quick)
#   make test-all    all three: every test there is
#   make ci          setup, lint, test
#
# A stamp in the venv makes `setup` return at once when pyproject.toml and the installer have not changed.
# PYTEST_ARGS adds to pytest's arguments, e.g. `make test-fast PYTEST_ARGS="-k ppo"`.

VENV ?= .venv
EXTRAS ?= test,recipe,trackers,openenv
PYTHON ?= python3
PYTEST_ARGS ?=
PY := $(VENV)/bin/python
PYTEST := $(PY) -m pytest -q -n 2 --dist loadgroup

.PHONY: setup system venv kafka run lint test-fast test test-soak test-recipes test-all ci

setup: system venv kafka

system:
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get install -y -q bubblewrap >/dev/null; } \
	  || echo "setup: no bubblewrap (root installs Debian's): the sandbox refuses untrusted code (docs/episodes.md)"
	@{ command -v java >/dev/null && command -v mvn >/dev/null; } || { [ "$$(id -u)" = 0 ] && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q openjdk-17-jre-headless maven >/dev/null; } \
	  || echo "setup: no Java or Maven: streamppo up runs on the memory broker, and the tests cannot run Apache Kafka"

venv:
	$(PYTHON) deploy/install.py --venv $(VENV) --extras $(EXTRAS)

kafka: venv
	$(PY) -m services.transport.brokers.apache_kafka fetch

run:
	$(PYTHON) deploy/install.py --venv $(VENV)
	$(VENV)/bin/streamppo run --config examples/vowels/config.yaml

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Each test target installs what it needs first (at once when nothing changed): after `make run`, whose venv has no
# test extras, `make test-fast` works as it is.
test-fast: venv
	$(PYTEST) -m "not slow" $(PYTEST_ARGS)

# The targets whose tests include containers start a Docker engine for them and stop it whatever happens.
WITH_ENGINE = trap 'deploy/docker/engine.sh stop' EXIT; deploy/docker/engine.sh start && deploy/docker/build.sh &&

test: setup
	@$(WITH_ENGINE) $(PYTEST) -m "not soak and not recipe" --durations=25 $(PYTEST_ARGS)

test-soak: setup
	@$(WITH_ENGINE) $(PYTEST) -m soak --durations=25 $(PYTEST_ARGS)

test-recipes: venv
	$(PYTEST) -m recipe --durations=25 $(PYTEST_ARGS)

test-all: setup
	@$(WITH_ENGINE) $(PYTEST) --durations=25 $(PYTEST_ARGS)

ci: setup lint test
