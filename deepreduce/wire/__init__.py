"""The bytes on the wire: the container format and the encodings its sections share.

``container`` (header, sections, CRC), ``varint`` (LEB128 counts), ``bitpack`` (fixed-width
integers), ``huffman_code`` (canonical Huffman tables), ``seeding`` (the per-(config, tensor,
step) seeds every rank derives alike), ``hashing`` (the seeded 64-bit mixers of the Bloom
filter and QSGD) and ``own_containers`` (a sender's record of what it sent, so it never decodes
its own container). Nothing here knows a framework or a collective.
"""
