"""The torch engine: continuous batching over a Hugging Face model on a KV cache, its fused decode
step for Llama models, and the prefix cache of finished rows.

Of generation, may import: types.
"""
