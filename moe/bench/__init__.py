"""Tools layer: expert-kernel benchmarks and tuners (`python -m moe.bench.experts`,
`moe.bench.tune`, `moe.bench.host`, `moe.bench.baselines`, `moe.bench.gpu_clocks`) and
the comm benchmark of `dbo bench-comm` (`moe.bench.comm`).
Nothing in the `moe` runtime or the models imports them."""
