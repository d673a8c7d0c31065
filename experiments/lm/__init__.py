"""A language model on the CPython standard library's source: a task that is not saturated.

:mod:`.data` finds, splits and tokenises the corpus (no download), :mod:`.tokenizer` is the
word-level tokenizer whose vocabulary gives the model a large, row-sparse embedding gradient,
:mod:`.model` the small transformer. ``deepreduce reproduce quality``
(:mod:`experiments.reproduce.quality`) trains it on two ranks over a shaped link.
"""
