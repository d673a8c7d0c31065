"""Index codecs. One module per codec; each registers itself."""
from ._base import IndexCodec, IndexEncoding

__all__ = ["IndexCodec", "IndexEncoding"]
