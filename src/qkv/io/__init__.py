"""Weights and tokenizers in and out: `load` (what `qkv.load` reads: an embedded name, a
folder, a GGUF file, a hub id or a training-run folder), Hugging Face folders (`hf`), GGUF
files, the embedded models, one module per model family (`families`), and the one atomic
writer every file qkv writes goes through (`files`).

Heavier imports (safetensors, tokenizers, gguf, huggingface_hub) stay inside the modules
that use them, so `import qkv` needs only torch. Nothing here imports a layer above
(train, pretrained, inspect, generate, viz, serve, cli): tests/io/test_layers.py checks.
"""
