"""kvtier's tools, apart from the library an engine imports: the ``kvtier`` command (``cli``), the demo, the soak
run, the workloads, the benchmarks (``bench``) and the reference engine (``engine``) that the demo and the
end-to-end tests run."""
