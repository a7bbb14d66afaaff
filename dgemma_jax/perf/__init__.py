"""Performance reports above the runtime: TPU AOT compile-and-fit reports (`aot`), the compiled
program's HBM traffic (`hbm_traffic`) and the roofline FLOP/byte model (`roofline`).

Nothing in the runtime path (model, sampling, engine, serving, training) imports this package; the CLI's
`dgemma compile`, the benchmarks and the tests do.
"""
