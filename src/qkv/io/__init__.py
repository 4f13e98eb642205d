"""Weights and tokenizers in and out: Hugging Face folders, GGUF files, embedded models.

Heavier imports (safetensors, tokenizers, gguf, huggingface_hub) stay inside the modules
that use them, so `import qkv` needs only torch.
"""
