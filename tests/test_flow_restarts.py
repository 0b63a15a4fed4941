"""Always-on restarts: backoff after consecutive failures and a cap that stops the loop (pure
decision by hand, then against a real Prefect API with the harness)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from prefect import flow
from prefect.states import Completed, Failed

from clawflow.restarts import restart_decision
from tasks.restarts import restart_guard

NOW = datetime(2026, 5, 1, 12, tzinfo=UTC)


def ago(s: float) -> datetime:
    return NOW - timedelta(seconds=s)


def decide(previous):
    return restart_decision(previous, NOW, max_failures=3, window_s=600, backoff_s=5, backoff_max_s=12)


def test_backoff_doubles_then_caps_and_a_good_run_resets_the_count():
    assert decide([]).start and decide([]).delay_s == 0
    assert decide([("FAILED", ago(1))]).delay_s == 5
    two = decide([("CRASHED", ago(1)), ("FAILED", ago(30))])
    assert two.start and two.failures == 2 and two.delay_s == 10
    stop = decide([("FAILED", ago(1)), ("FAILED", ago(2)), ("CRASHED", ago(3)), ("FAILED", ago(4))])
    assert not stop.start and stop.failures == 4 and "4 consecutive failures within 600s (cap 3)" in stop.reason
    # a non-failed run (a manual start that ran, or the guard's own Cancelled stop) ends the chain
    assert decide([("FAILED", ago(1)), ("CANCELLED", ago(2)), ("FAILED", ago(3)), ("FAILED", ago(4))]).failures == 1
    assert decide([("FAILED", ago(1)), ("FAILED", ago(700)), ("FAILED", ago(800))]).failures == 1  # outside the window
    assert restart_decision([("FAILED", ago(1))] * 2, NOW, 5, 600, 100, 120).delay_s == 120  # capped delay


@flow(name="guard-probe")
def guard_probe(cfg):
    return restart_guard(cfg, "serve-policy")


def test_serve_policy_stops_restarting_after_the_cap(make_config, prefect_api):
    from prefect.client.orchestration import get_client

    from flows.serve_policy import serve_policy

    cfg = make_config(services={"restart_max_failures": 3, "restart_backoff_s": 0.05, "restart_backoff_max_s": 1})
    with get_client(sync_client=True) as client:
        dep = client.create_deployment(flow_id=client.create_flow_from_name("serve-policy"), name="serve-policy")

        def run_ending(state):
            run = client.create_flow_run_from_deployment(dep)
            client.set_flow_run_state(run.id, state, force=True)

        run_ending(Completed())
        run_ending(Failed(message="port taken"))
        run_ending(Failed(message="port taken"))
        decision = guard_probe(cfg)
        assert decision.start and decision.failures == 2 and decision.delay_s == 0.1

        run_ending(Failed(message="port taken"))
        state = serve_policy(config_path=str(cfg.source_file), restart=True, return_state=True)
        assert state.is_cancelled(), state
        assert "3 consecutive failures" in state.message and "start it by hand" in state.message

        # a manual start is never held back (restart=False skips the guard); its run resets the chain
        run_ending(Completed())
        assert guard_probe(cfg).failures == 0
