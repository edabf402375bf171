"""Tests of the moe runtime: config, router, layer, modular kernel, backends, experts, kernels, workspaces."""
