"""bitpack: the C++ kernel (deepreduce._container) and the strided byte-window paths give the
layout of the definition, for every width."""
import contextlib
import os
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepreduce.backend import _native
from deepreduce.errors import ContainerError
from deepreduce.wire import bitpack

BACKENDS = ["c++", "numpy"]


def backend(name):
    """The C++ kernel (skipped when it is not built) or the array-namespace code (forced)."""
    if name == "numpy":
        return mock.patch.dict(os.environ, {"DEEPREDUCE_BACKEND": "numpy"})
    if _native.load("container") is None:
        pytest.skip("C++ extension deepreduce._container not built")
    return contextlib.nullcontext()


def reference_pack(values, width):
    """The module docstring's layout, bit by bit: entry i's bit j is stream bit i*width + j."""
    out = bytearray(bitpack.packed_size(len(values), width))
    for i, v in enumerate(int(x) for x in values):
        for j in range(width):
            if v >> j & 1:
                p = i * width + j
                out[p // 8] |= 1 << (p % 8)
    return bytes(out)


@pytest.mark.parametrize("name", BACKENDS)
@settings(max_examples=200, deadline=None)
@given(width=st.integers(1, 64), data=st.data())
def test_pack_and_unpack_follow_the_layout(name, width, data):
    n = data.draw(st.integers(0, 40))
    values = np.array(data.draw(st.lists(st.integers(0, (1 << width) - 1), min_size=n, max_size=n)),
                      dtype=np.uint64)
    with backend(name):
        packed = bitpack.pack(values, width)
        assert packed == reference_pack(values, width)
        unpacked = bitpack.unpack(packed, width, n)
        assert unpacked.dtype == np.uint64 and np.array_equal(unpacked, values)
        # a section cut out of a container (a uint8 array view) unpacks alike
        assert np.array_equal(bitpack.unpack(np.frombuffer(b"x" + packed, np.uint8)[1:], width, n), values)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("width", [1, 3, 8, 18, 19, 56, 57, 64])
def test_large_round_trip_every_residue_class(name, width):
    rng = np.random.default_rng(width)
    values = rng.integers(0, (1 << width) - 1, size=10_007, dtype=np.uint64, endpoint=True)
    with backend(name):
        packed = bitpack.pack(values, width)
        assert len(packed) == bitpack.packed_size(values.size, width)
        assert np.array_equal(bitpack.unpack(packed, width, values.size), values)
        with pytest.raises(ContainerError, match=f"packed section has {len(packed) - 1} bytes, expected {len(packed)}"):
            bitpack.unpack(packed[:-1], width, values.size)
        with pytest.raises(ContainerError, match="bit width must be in"):
            bitpack.unpack(packed, 65, values.size)
        with pytest.raises(ValueError):
            bitpack.pack(np.array([1 << width]) if width < 64 else np.array([0]), width if width < 64 else 65)


def test_kernel_refuses_a_hostile_count_before_allocating():
    native = _native.load("container")
    if native is None:
        pytest.skip("C++ extension deepreduce._container not built")
    with pytest.raises(ValueError, match="packed section has 3 bytes, expected"):
        native.bit_unpack(b"abc", 17, 2**60)
