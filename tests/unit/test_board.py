"""popmesh.observe.board.Board in a world of one, read back with TensorBoard's own reader."""

from __future__ import annotations

import math

import pytest

import popmesh
from popmesh import ConfigError
from popmesh.observe.board import Board


def _read(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(path))
    board.Reload()
    return board


def test_each_rank_writes_its_own_run_and_none_is_skipped(tmp_path):
    popmesh.init("local")
    with Board(tmp_path) as board:
        board.scalars({"loss": 1.5, "return": None}, step=10)
        board.scalar("loss", math.nan, step=20)  # a broken value is shown, not hidden
        board.text("events", "rank 0 <- mean(rank 1, rank 2)", step=20)
    read = _read(tmp_path / "rank-0")
    assert read.Tags()["scalars"] == ["loss"]
    values = [(e.step, e.value) for e in read.Scalars("loss")]
    assert values[0] == (10, 1.5) and values[1][0] == 20 and math.isnan(values[1][1])


def test_main_only_and_bad_input(tmp_path):
    popmesh.init("local")
    with Board(tmp_path, ranks="main") as board:
        board.scalar("x", 2, step=1)
        with pytest.raises(ConfigError, match="real number"):
            board.scalar("x", "2", step=2)
    assert [e.value for e in _read(tmp_path / "main").Scalars("x")] == [2.0]
    with pytest.raises(ConfigError, match="'all'"):
        Board(tmp_path, ranks="rank0")  # type: ignore[arg-type]
    assert popmesh.Board is Board
