"""Performance reports above the runtime: TPU AOT compile-and-fit reports (`aot`), the compiled
program's HBM traffic (`hbm_traffic`), the roofline FLOP/byte model (`roofline`), the compiled
program's cost and memory as XLA reports them (`compiled`), and the benchmarks' report writer
(`report`: machine metadata, results JSON, markdown tables).

Nothing in the runtime path (model, sampling, engine, serving, training) imports this package; the CLI's
`dgemma compile`, the benchmarks and the tests do.
"""
