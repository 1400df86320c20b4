"""The server's GIL switch interval (server/run.py: switch_interval) and merge()'s one-source path."""

import asyncio

import pytest

from mlx_infer import defaults
from mlx_infer.errors import MlxInferError
from mlx_infer.server.run import switch_interval
from mlx_infer.server.streaming import merge


def test_switch_interval_default_and_override(monkeypatch):
    monkeypatch.delenv("MLX_INFER_SWITCH_INTERVAL", raising=False)
    assert switch_interval() == defaults.SERVER_SWITCH_INTERVAL_S > 0.005  # above Python's 5 ms
    monkeypatch.setenv("MLX_INFER_SWITCH_INTERVAL", "0.002")
    assert switch_interval() == 0.002
    for bad in ("fast", "0", "-1"):
        monkeypatch.setenv("MLX_INFER_SWITCH_INTERVAL", bad)
        with pytest.raises(MlxInferError, match="MLX_INFER_SWITCH_INTERVAL"):
            switch_interval()


def test_merge_of_one_source_yields_it_and_closes_it_early():
    closed = []

    async def source():
        try:
            for i in range(5):
                yield i
        finally:
            closed.append(True)

    async def main():
        assert [x async for x in merge([source()])] == [0, 1, 2, 3, 4]
        gen = merge([source()])
        assert await gen.__anext__() == 0
        await gen.aclose()  # the client left after one chunk
        return closed

    assert asyncio.run(main()) == [True, True]
