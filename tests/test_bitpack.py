"""bitpack: the strided byte-window paths give the layout of the definition, for every width."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepreduce import bitpack
from deepreduce.errors import ContainerError


def reference_pack(values, width):
    """The module docstring's layout, bit by bit: entry i's bit j is stream bit i*width + j."""
    out = bytearray(bitpack.packed_size(len(values), width))
    for i, v in enumerate(int(x) for x in values):
        for j in range(width):
            if v >> j & 1:
                p = i * width + j
                out[p // 8] |= 1 << (p % 8)
    return bytes(out)


@settings(max_examples=200, deadline=None)
@given(width=st.integers(1, 64), data=st.data())
def test_pack_and_unpack_follow_the_layout(width, data):
    n = data.draw(st.integers(0, 40))
    values = np.array(data.draw(st.lists(st.integers(0, (1 << width) - 1), min_size=n, max_size=n)),
                      dtype=np.uint64)
    packed = bitpack.pack(values, width)
    assert packed == reference_pack(values, width)
    assert np.array_equal(bitpack.unpack(packed, width, n), values)


@pytest.mark.parametrize("width", [1, 3, 8, 18, 19, 56, 57, 64])
def test_large_round_trip_every_residue_class(width):
    rng = np.random.default_rng(width)
    values = rng.integers(0, (1 << width) - 1, size=10_007, dtype=np.uint64, endpoint=True)
    packed = bitpack.pack(values, width)
    assert len(packed) == bitpack.packed_size(values.size, width)
    assert np.array_equal(bitpack.unpack(packed, width, values.size), values)
    with pytest.raises(ContainerError):
        bitpack.unpack(packed[:-1], width, values.size)
    with pytest.raises(ValueError):
        bitpack.pack(np.array([1 << width]) if width < 64 else np.array([0]), width if width < 64 else 65)
