"""Array namespaces: one definition of each codec runs on NumPy arrays and on torch tensors.

The codecs that have a device path are written once against the Python array API standard
(through ``array_api_compat``): ``namespace(x)`` is NumPy's or torch's standard namespace, and
the same function runs on NumPy arrays on the host or on torch tensors on any device (CPU or
CUDA), computing on the tensor's own device. The C++ kernels (``csrc/``) stay the fast path
for NumPy on the CPU; codecs pick them only for NumPy input.

What the standard lacks is in one small :class:`Adapter` per framework (:func:`adapter`):

* **64-bit hash words.** The Bloom and counter-based hashes are defined on uint64 with
  wrapping arithmetic. NumPy has uint64; torch's uint64 lacks shifts, additions and
  comparisons, so torch words are int64 tensors holding the same 64 bits: ``+ - * ^ & |``
  agree bit for bit modulo 2**64 (two's complement), a logical right shift masks the sign
  extension (:meth:`Adapter.shr`), constants above 2**63 are written as their signed
  equivalents (:meth:`Adapter.const`), and unsigned order is the signed order of the words
  with the top bit flipped (:meth:`Adapter.order_key`).
* **Bytes.** A section of a container is ``bytes`` on the NumPy path and a 1-D uint8 array on
  the tensor's device on the device path; :meth:`Adapter.from_section` and
  :meth:`Adapter.as_bytes` convert between typed arrays and little-endian bytes.
* **Bit packing** (``numpy.packbits`` with ``bitorder="little"``), **gather** and
  **scatter-add** into a buffer.
"""
from __future__ import annotations

import functools
import sys
import warnings
from typing import Union

import array_api_compat
import numpy as np

MASK64 = (1 << 64) - 1
_TOP = 1 << 63
_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


NUMPY_NAMESPACE = array_api_compat.array_namespace(np.empty(0))


@functools.lru_cache(maxsize=None)
def _native_order(dtype: str) -> np.dtype:
    """NumPy ``dtype`` (e.g. ``"<f4"``) in this host's byte order (a handful of dtypes, asked per section)."""
    return np.dtype(dtype).newbyteorder("=")


def namespace(*arrays):
    """The array-API namespace of ``arrays`` (NumPy's or torch's, via array_api_compat); NumPy
    arrays, the host path of every tensor of every step, are answered without the look-up."""
    if all(type(a) is np.ndarray for a in arrays):
        return NUMPY_NAMESPACE
    return array_api_compat.array_namespace(*arrays)


def is_torch(x) -> bool:
    """Whether ``x`` is a torch tensor (without importing torch: a process that never imported it
    holds none). Called on every section of every container, so a NumPy array is answered first."""
    if type(x) is np.ndarray:
        return False
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


class Adapter:
    """What the array API standard lacks, for NumPy (this class) or torch (:class:`TorchAdapter`)."""

    name = "numpy"
    word_dtype = np.uint64

    # -- 64-bit words -------------------------------------------------------------------
    def words(self, x):
        """Integers as 64-bit hash words (int64 ones reinterpreted, the same bits as a cast)."""
        x = np.asarray(x)
        return x.view(np.uint64) if x.dtype == np.int64 else x.astype(np.uint64, copy=False)

    def const(self, c: int):
        """A constant in ``[0, 2**64)`` as a word scalar."""
        return np.uint64(c & MASK64)

    def shr(self, x, s: int):
        """Logical right shift of words."""
        return x >> np.uint64(s)

    def shl(self, x, s: int):
        """Left shift of words (wrapping)."""
        return x << np.uint64(s)

    def order_key(self, x):
        """Words whose native order is the unsigned order of ``x``."""
        return x

    def index(self, x):
        """Words (below 2**63) as int64 positions (uint64 words are reinterpreted, not copied)."""
        return x.view(np.int64) if x.dtype == np.uint64 else x.astype(np.int64)

    # -- bytes --------------------------------------------------------------------------
    def from_section(self, section, dtype: str, like=None):
        """A little-endian section (bytes, or a uint8 array) as an array of NumPy ``dtype``
        (e.g. ``"<f4"``) in this framework (on ``like``'s device)."""
        return np.frombuffer(section if isinstance(section, (bytes, bytearray)) else bytes(section),
                             dtype=dtype).astype(_native_order(dtype))

    def as_bytes(self, x) -> Union[bytes, "object"]:
        """An array as its little-endian bytes: ``bytes`` for NumPy, a uint8 tensor for torch."""
        return np.ascontiguousarray(x).astype(x.dtype.newbyteorder("<"), copy=False).tobytes()

    def concat_bytes(self, parts):
        """Sections (as :meth:`as_bytes` returns them) joined into one."""
        return b"".join(parts)

    def uint_bytes(self, x, itemsize: int):
        """Non-negative integers below ``2**(8*itemsize)`` as little-endian unsigned bytes."""
        return np.asarray(x).astype(f"<u{itemsize}").tobytes()

    def packbits(self, bits):
        """A bool array as bytes (bit ``j`` at bit ``j % 8`` of byte ``j // 8``)."""
        return np.packbits(bits, bitorder="little").tobytes()

    def unpackbits(self, section):
        """A section's bits as a uint8 array of 0/1 (inverse of :meth:`packbits`)."""
        raw = np.frombuffer(section if isinstance(section, (bytes, bytearray)) else bytes(section), np.uint8)
        return np.unpackbits(raw, bitorder="little")

    def gather(self, x, indices):
        """``x[indices]`` for a 1-D ``x`` and int64 ``indices``."""
        return np.take(x, indices)

    # -- selection ------------------------------------------------------------------------
    def positions(self, mask):
        """Ascending int64 positions where the 1-D bool ``mask`` holds."""
        return np.flatnonzero(mask).astype(np.int64, copy=False)

    def kth_largest(self, x, k: int) -> float:
        """The ``k``-th largest entry of the 1-D ``x`` (``1 <= k <= len(x)``) as a Python float."""
        return float(np.partition(x, x.shape[0] - k)[x.shape[0] - k])

    # -- accumulate -----------------------------------------------------------------------
    def scatter_add(self, out, indices, values) -> None:
        """``out[indices] += values`` for distinct indices, in place."""
        out[indices] += values

    def to_numpy(self, x) -> np.ndarray:
        return np.asarray(x)

    def from_numpy(self, x: np.ndarray, like=None):
        """A NumPy array in this framework, on ``like``'s device."""
        return x


class TorchAdapter(Adapter):
    """torch: int64 words with NumPy's uint64 bits; sections as uint8 tensors on the device."""

    name = "torch"

    def __init__(self) -> None:
        import torch

        if sys.byteorder != "little":
            raise RuntimeError("deepreduce's torch device path needs a little-endian host")
        self.torch = torch
        self.word_dtype = torch.int64
        self._dtypes = {"<f4": torch.float32, "<f2": torch.float16, "<i1": torch.int8, "|i1": torch.int8,
                        "<i2": torch.int16,
                        "<u1": torch.uint8, "<i4": torch.int32, "<u8": torch.int64, "<i8": torch.int64}

    def words(self, x):
        return x.to(self.torch.int64)

    def const(self, c: int):
        c &= MASK64
        return c - (1 << 64) if c & _TOP else c

    def shr(self, x, s: int):
        shifted = self.torch.bitwise_right_shift(x, s)
        return shifted if s == 0 else shifted & ((1 << (64 - s)) - 1)

    def shl(self, x, s: int):
        return self.torch.bitwise_left_shift(x, s)

    def order_key(self, x):
        return x ^ self.const(_TOP)

    def index(self, x):
        return x

    def from_section(self, section, dtype: str, like=None):
        torch = self.torch
        if isinstance(section, (bytes, bytearray)):
            raw = torch.frombuffer(bytearray(section), dtype=torch.uint8) if section else \
                torch.zeros(0, dtype=torch.uint8)
            raw = raw.to(like.device) if like is not None else raw
        else:
            raw = section.contiguous().clone()   # a slice of a container: realign for the view
        if dtype == "<u4":   # as int32 (same bits), widened to int64 without the sign: 3 kernels, not 10
            return raw.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        return raw.view(self._dtypes[dtype])

    def as_bytes(self, x):
        if x.numel() == 0:   # torch keeps a stride of 0 (as_strided, expand) through contiguous(),
            return self.torch.zeros(0, dtype=self.torch.uint8, device=x.device)   # and view needs 1
        return x.contiguous().reshape(-1).view(self.torch.uint8)

    def concat_bytes(self, parts):
        return self.torch.cat(parts)

    def uint_bytes(self, x, itemsize: int):
        return self.as_bytes(x.to(self.torch.int64)).reshape(-1, 8)[:, :itemsize].reshape(-1)

    def packbits(self, bits):
        torch = self.torch
        weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=bits.device)
        bits = bits.reshape(-1).to(torch.uint8)
        if bits.numel() % 8:   # the last byte zero padded, as numpy.packbits does
            bits = torch.cat([bits, bits.new_zeros(8 - bits.numel() % 8)])
        return (bits.reshape(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)

    def unpackbits(self, section):
        raw = self.from_section(section, "<u1")
        weights = self.torch.tensor(_BIT_WEIGHTS, dtype=self.torch.uint8, device=raw.device)
        return ((raw[:, None] & weights) != 0).to(self.torch.uint8).reshape(-1)

    def gather(self, x, indices):
        return x.index_select(0, indices)

    def positions(self, mask):
        return self.torch.nonzero(mask, as_tuple=False).flatten()

    def kth_largest(self, x, k: int) -> float:
        return float(self.torch.topk(x, k, sorted=False).values.min())

    def scatter_add(self, out, indices, values) -> None:
        out.index_add_(0, indices, values.to(out.dtype))

    def to_numpy(self, x) -> np.ndarray:
        return x.detach().cpu().numpy()

    def all_finite(self, x) -> bool:
        """One float64 sum, NaN/Inf exactly when an entry is (float32 magnitudes cannot overflow
        it), without a boolean tensor."""
        return bool(self.finite_flag(x))

    def read_flags(self, flags) -> list:
        """The values of 0-d (or one-element) boolean tensors, read back in one copy."""
        return self.torch.stack([flag.reshape(()) for flag in flags]).cpu().tolist()

    def finite_flag(self, x):
        """:meth:`all_finite` as a 0-d boolean tensor on ``x``'s device (nothing read back)."""
        return self.torch.isfinite(x.sum(dtype=self.torch.float64))

    def from_numpy(self, x: np.ndarray, like=None):
        x = np.ascontiguousarray(x)
        t = self.torch.from_numpy(x if x.flags.writeable else x.copy())
        return t if like is None else t.to(like.device)


def join_sections(parts, like):
    """Sections (``bytes`` and, for a torch ``like``, uint8 tensors) joined into one: ``bytes``
    for NumPy, a uint8 tensor on ``like``'s device for torch."""
    a = adapter(like)
    if a.name == "numpy":
        return b"".join(bytes(p) for p in parts)
    return a.concat_bytes([p if is_torch(p) else a.from_numpy(np.frombuffer(bytes(p), dtype=np.uint8), like)
                           for p in parts])


def head_bytes(section, size: int) -> bytes:
    """The first ``size`` bytes of a section (bytes or a uint8 array on any device) as ``bytes``."""
    return bytes(adapter(section).to_numpy(section[:size])) if is_torch(section) else bytes(section[:size])


def as_float32(values):
    """Values as a float32 array of their own framework (NumPy for lists and NumPy input)."""
    if is_torch(values):
        return values.float()
    return np.asarray(values, dtype=np.float32)


def host_fallback(component: str) -> None:
    """Warn once per component that it runs on the host for device tensors (compact data only
    crosses; :func:`fallbacks` lists them for ``backends()`` reports)."""
    if component in _fallbacks:
        return
    _fallbacks.add(component)
    warnings.warn(f"deepreduce: {component} has no device implementation; it runs on the host "
                  "(its compact input is copied there and back)", RuntimeWarning, stacklevel=3)


def fallbacks() -> frozenset:
    """Components that have fallen back to the host for device tensors so far."""
    return frozenset(_fallbacks)


_fallbacks: set = set()
NUMPY = Adapter()
_torch_adapter = None


def adapter(x) -> Adapter:
    """The adapter of ``x``'s framework (NumPy for anything that is not a torch tensor)."""
    global _torch_adapter
    if not is_torch(x):
        return NUMPY
    if _torch_adapter is None:
        _torch_adapter = TorchAdapter()
    return _torch_adapter
