"""Tests of the tools: the `dbo` command and its jobs (dbo.cli), the expert benches (moe.bench)."""
