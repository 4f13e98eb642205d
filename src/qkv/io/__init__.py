"""Weights and tokenizers in and out: `load` (what `qkv.load` reads: an embedded name, a
folder, a GGUF file, a hub id or a training-run folder), Hugging Face folders on disk
(`hf_folder`; `qkv.hf` is the other way round, qkv's attention inside transformers), GGUF
files, the embedded models, one module per model family (`families`), a model built from a
family's tensors (`build`), and the one atomic writer every file qkv writes goes through
(`files`).

Heavier imports (tokenizers, gguf, huggingface_hub, jinja2) stay inside the modules that
use them, so `import qkv` needs only torch. Nothing here imports a layer above (train,
pretrained, inspect, generate, viz, serve, cli): tests/io/test_layers.py checks.
"""
