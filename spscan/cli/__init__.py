"""The command line (``python -m spscan demo`` / ``bench``): the demo, its datasets, the benchmark
runner and its report writer. Not part of the library's API; the library never imports it."""
