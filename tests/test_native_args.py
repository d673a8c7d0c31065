"""The C++ entry points check their arguments and raise ValueError / TypeError: no argument
crashes the process (issue 13: sizes, m, k, dtypes; floats are never truncated to indices)."""
import numpy as np
import pytest

bloom = pytest.importorskip("deepreduce._bloom", reason="needs the C++ extensions (make setup)")
select = pytest.importorskip("deepreduce._select", reason="needs the C++ extensions (make setup)")
fit = pytest.importorskip("deepreduce._fit", reason="needs the C++ extensions (make setup)")

U64 = 2**64 - 1
IDX = np.array([1, 2, 3], np.uint64)
F32 = np.zeros(4, np.float32)


@pytest.mark.parametrize("call, error, message", [
    (lambda: bloom.build(IDX, U64, 3, 0), ValueError, r"blocks = 18446744073709551615 is outside \[0, 2147483647\]"),
    (lambda: bloom.build(IDX, 4, U64, 0), ValueError, r"k = 18446744073709551615 is outside \[1, 64\]"),
    (lambda: bloom.build(IDX, 4, 3, 0, 10**6), ValueError, r"threads = 1000000 is outside \[1, 256\]"),
    (lambda: bloom.build(np.array([1.5, 2.0]), 4, 3, 0), TypeError, "indices must be an integer array, got dtype float64"),
    (lambda: bloom.build(np.array([-1, 2]), 4, 3, 0), ValueError, "indices must be non-negative"),
    (lambda: bloom.build(IDX, 4.0, 3, 0), TypeError, "blocks must be an integer"),
    (lambda: bloom.query(b"", U64, 3, 0, 10, 10, 1, "splitmix"), ValueError, "expected 2305843009213693952 for m = 18446744073709551615"),
    (lambda: bloom.query(b"", U64 - 6, 3, 0, 10, 10, 1, "splitmix"), ValueError, "for m = 18446744073709551609"),
    (lambda: bloom.query(b"\0" * 64, 1, 3, 0, 10, 10, 1, "cuckoo"), ValueError, "family must be 'blocked' or 'splitmix'"),
    (lambda: bloom.select_conflict(np.array([3, 2, 1], np.uint64), 2, 4, 3, 0, 0, "blocked"), ValueError, "strictly ascending"),
    (lambda: bloom.select_conflict(np.array([1.0, 2.0]), 1, 4, 3, 0, 0, "blocked"), TypeError, "positives must be an integer array"),
    (lambda: bloom.select_conflict(IDX, 2, 4, 65, 0, 0, "blocked"), ValueError, r"k = 65 is outside \[1, 64\]"),
    (lambda: bloom.select_random(IDX, 5, 0), ValueError, r"r = 5 is outside \[0, 3\]"),
    (lambda: select.scatter_add(F32.copy(), np.array([0.5, 1.7]), np.ones(2, np.float32), 1), TypeError,
     "indices must be an integer array, got dtype float64"),
    (lambda: select.scatter_add_unchecked(F32.copy(), np.array([0.5]), np.ones(1, np.float32), 1), TypeError,
     "indices must be an integer array"),
    (lambda: select.scatter_add(F32.copy(), np.array([0, 9]), np.ones(2, np.float32), 1), ValueError, "out of range"),
    (lambda: select.scatter_add(np.zeros(4), np.array([0, 1]), np.ones(2, np.float32), 1), TypeError,
     "out must be a writeable C-contiguous float32 array"),
    (lambda: select.scatter_add(F32.copy(), np.array([0, 1]), np.ones(3, np.float32), 1), ValueError, "differ in length"),
    (lambda: select.scatter_add(F32.copy(), np.array([0, 1]), np.ones(2, np.float32), 10**6), ValueError,
     r"threads = 1000000 is outside \[1, 256\]"),
    (lambda: select.scan(np.ones(4, np.float32), np.zeros(4), 2, 1), TypeError, "residual must be a writeable"),
    (lambda: select.scan(np.ones(4, np.float32), np.zeros(3, np.float32), 2, 1), ValueError, "differ in size"),
    (lambda: select.topk(np.ones(4, np.float32), 10, 1), ValueError, "0 < r < n"),
    (lambda: select.topk(np.ones(4, np.float32), 2**70, 1), TypeError, "incompatible function arguments"),
    (lambda: select.nonzero(np.ones(4, np.float32), 0), ValueError, r"threads = 0 is outside \[1, 256\]"),
    (lambda: fit.decode(b"\0\0\0\0" + b"\xff\xff\xff\xff" * 2, 2**40, 5, 4), ValueError, "segment table"),
    (lambda: fit.decode(b"", 2**62, 5, 4), ValueError, "has 0 bytes; at least 4 expected"),
    (lambda: fit.decode(b"\0" * 100, 10, 99, 4), ValueError, "invalid polyfit argument"),
    (lambda: fit.encode(np.ones(10, np.float32), 99, 0, 6, 3), ValueError, "invalid polyfit argument"),
])
def test_bad_arguments_raise(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_read_only_output_is_refused_not_copied():
    out = np.zeros(4, np.float32)
    out.flags.writeable = False
    with pytest.raises(TypeError, match="writeable"):
        select.scatter_add(out, np.array([0, 1]), np.ones(2, np.float32), 1)


def test_valid_calls_still_work():
    filt = bloom.build(IDX, 1, 3, 0)
    positives = bloom.query(filt, 1, 3, 0, 10, 10)
    assert set(IDX.tolist()) <= set(positives.tolist())
    out = np.zeros(4, np.float32)
    select.scatter_add(out, np.array([0, 2], np.int32), np.ones(2, np.float32), 1)
    assert out.tolist() == [1.0, 0.0, 1.0, 0.0]
