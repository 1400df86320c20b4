"""The C++ extension loads against the installed mlx and arrays cross both ways."""

import mlx.core as mx
import pytest

import mlx_infer
from mlx_infer import _fast
from mlx_infer._version_check import REQUIRED_MLX_VERSION, check_mlx_version


def test_built_against_installed_mlx():
    assert _fast.built_mlx_version() == mx.__version__ == REQUIRED_MLX_VERSION


def test_slot_mapping_takes_and_returns_mlx_arrays():
    tables = mx.array([[3, 1, 2], [5, 0, 0]], dtype=mx.int32)
    positions = mx.array([[0, 15, 16, 40], [0, 1, 2, 3]], dtype=mx.int32)
    slots = _fast.slot_mapping(tables, positions, page_size=16)
    assert isinstance(slots, mx.array)
    assert slots.dtype == mx.int32
    assert slots.tolist() == [[48, 63, 16, 40], [80, 81, 82, 83]]


def test_slot_mapping_rejects_bad_input_with_a_message():
    with pytest.raises(ValueError, match="page_size must be positive"):
        _fast.slot_mapping(mx.zeros((1, 1), mx.int32), mx.zeros((1, 1), mx.int32), page_size=0)
    with pytest.raises(ValueError, match="batch size"):
        _fast.slot_mapping(mx.zeros((2, 1), mx.int32), mx.zeros((1, 1), mx.int32), page_size=16)


def test_version_mismatch_names_both_versions():
    with pytest.raises(ImportError, match=r"built against mlx 0\.32\.4, but mlx 0\.99\.0 is installed"):
        check_mlx_version("0.99.0", "0.32.4")
    check_mlx_version(REQUIRED_MLX_VERSION)  # the installed one passes
    assert mlx_infer.__version__
