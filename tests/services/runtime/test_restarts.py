"""One restart policy for `streamppo up`'s children and the learner's ranks (services/runtime/restarts.py)."""

from services.runtime.restarts import RestartPolicy, Restarts


def test_quick_failures_in_a_row_give_up_and_the_pause_grows():
    restarts = Restarts(RestartPolicy(delays_s=(1, 2, 4), quick_failure_s=60, give_up_after=3))
    assert [restarts.after_exit(1, ran_s=5) for _ in range(3)] == [1, 2, 4]
    assert restarts.after_exit(1, ran_s=5) is None, "the fourth quick failure in a row: not transient"


def test_a_process_that_ran_a_while_starts_the_count_again():
    restarts = Restarts(RestartPolicy(delays_s=(1, 2, 4), quick_failure_s=60, give_up_after=2))
    assert restarts.after_exit(1, ran_s=5) == 1 and restarts.after_exit(1, ran_s=5) == 2
    assert restarts.after_exit(1, ran_s=600) == 1, "its failure says nothing about the next start"
    assert restarts.after_exit(1, ran_s=5) == 2


def test_a_process_killed_by_a_signal_is_restarted_however_often():
    restarts = Restarts(RestartPolicy(delays_s=(1, 30), give_up_after=1))
    assert [restarts.after_exit(-9, ran_s=1) for _ in range(10)] == [1] + [30] * 9
    assert restarts.after_exit(1, ran_s=1) is None, "its own error, after quick failures: give up"


def test_up_and_the_learner_ranks_share_the_policy(make_config):
    from services.launch.cluster import _Child
    from services.learner.ranks import LearnerRanks

    ranks = LearnerRanks(make_config("learner.parallel.strategy=fsdp", "learner.parallel.processes=2"))
    child = _Child("scorer-0", [])
    assert ranks.policy.delays_s == child.restarts.policy.delays_s
    assert ranks.policy.quick_failure_s == child.restarts.policy.quick_failure_s
    assert ranks.policy.give_up_after == 3, "learner.parallel.max_restarts"


def test_up_starts_again_in_resume_mode_only_the_services_that_could_not_go_on_on_a_new_log(monkeypatch, capsys):
    """The others go on on the new log in their processes (Service.take_up_new_log); stopping them would cost their
    models' loading again."""
    from services.launch import cluster

    spawned = []
    monkeypatch.setattr(cluster, "_spawn", lambda child: spawned.append((child.name, list(child.args))))
    children = {
        name: cluster._Child(name, [name.split("-")[0], "--config", "run.yaml"]) for name in ("gateway-0", "scorer-0")
    }
    cluster._resume_on_the_new_log(children, ["gateway-0"])
    assert spawned == [("gateway-0", ["gateway", "--config", "run.yaml", *cluster.RESUME])]
    assert "gateway-0 found the run's log gone" in capsys.readouterr().out
    cluster._resume_on_the_new_log(children, ["gateway-0"])
    assert spawned[-1][1].count(cluster.RESUME[1]) == 1, "resume mode is asked for once"


def test_by_default_the_first_failure_is_restarted_at_once_and_the_pause_grows_from_the_second():
    """A single replica of a role costs the pipeline its start time, not a back-off too; one that fails again
    soon after waits, and longer each time."""
    restarts = Restarts()
    assert restarts.after_exit(-9, ran_s=20) == 0
    assert 0 < restarts.after_exit(-9, ran_s=2) < restarts.after_exit(-9, ran_s=2)
