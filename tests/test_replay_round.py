"""bench/replay_round.py: the recorded training command, replayed with another config, output and cache."""

import pytest

from bench.replay_round import replay_argv

LINE = ("$ /v/bin/python -m torch.distributed.run --standalone --nproc_per_node=1 -m clawflow.train.recipe "
        "--config /h/bench-config.yaml --base /h/checkpoints/a.doses/dose-0.75 --batch /h/runs/b/samples.parquet "
        "--out /h/checkpoints/b --parent-version 3 --cache-dir /h/rewrites --broad-seed 6")


def test_the_replay_keeps_start_weights_batch_and_seed_and_swaps_config_output_and_cache(tmp_path):
    argv = replay_argv(LINE, tmp_path / "c.yaml", tmp_path / "cand", tmp_path / "rw")
    assert argv[0] == "/v/bin/python" and "$" not in argv
    got = dict(zip(argv[argv.index("--config")::2], argv[argv.index("--config") + 1::2]))
    assert got == {"--config": str(tmp_path / "c.yaml"), "--base": "/h/checkpoints/a.doses/dose-0.75",
                   "--batch": "/h/runs/b/samples.parquet", "--out": str(tmp_path / "cand"),
                   "--parent-version": "3", "--cache-dir": str(tmp_path / "rw"), "--broad-seed": "6"}


@pytest.mark.parametrize("line, why", [("$ ls -la", "not a recorded training command"),
                                       (LINE.replace(" --cache-dir /h/rewrites", ""), "no --cache-dir")])
def test_a_line_that_is_not_a_full_training_command_is_refused(line, why, tmp_path):
    with pytest.raises(ValueError, match=why):
        replay_argv(line, tmp_path / "c.yaml", tmp_path / "o", tmp_path / "r")
