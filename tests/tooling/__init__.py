"""The project around the library: packaging, docstring examples, examples/, benchmarks/, and the
test suite's own memory-map guard (tests/conftest.py)."""
