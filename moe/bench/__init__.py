"""Tools layer: expert-kernel benchmarks and tuners (`python -m moe.bench.experts`,
`moe.bench.tune`, `moe.bench.host`, `moe.bench.baselines`, `moe.bench.gpu_clocks`).
Nothing in the `moe` runtime or the models imports them."""
