"""Models layer: the reference transformer (`moe.models.transformer`) and its presets
(`moe.models.presets`). Built on the `moe` runtime; the runtime never imports it."""
