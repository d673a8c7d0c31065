"""Reference models used by the example jobs and the experiments."""
