"""Tests of the models: the reference transformer (moe.models) and the Hugging Face adapters (moe.hf)."""
