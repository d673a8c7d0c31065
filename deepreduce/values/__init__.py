"""Value codecs. One module per codec; each registers itself."""
from ._base import ValueCodec, ValueEncoding

__all__ = ["ValueCodec", "ValueEncoding"]
