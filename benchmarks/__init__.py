"""Benchmarks against FlashInfer and Hugging Face; see BENCHMARKS.md."""
