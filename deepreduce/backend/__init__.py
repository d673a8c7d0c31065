"""Where code runs: array namespaces (NumPy or torch, via array-api-compat), the loader of the
optional C++ extensions (``_native``), the kernels that pick C++ or NumPy (``kernels``) and the
thread-count policy of those kernels (``parallel``)."""
