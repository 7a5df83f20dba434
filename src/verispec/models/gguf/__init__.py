"""verispec's own quantized CPU runner for GGUF models: weights stay in their block formats (repacked once
at load), matmuls run in C kernels over int8-quantized activations, and every op computes a row with the
same arithmetic whatever the pass width (batch invariance)."""
