"""Benchmark harness: verispec side by side with the systems users would otherwise pick."""
