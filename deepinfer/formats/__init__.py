"""Formats at the bottom of the tree: how cache entries are quantised (fp4) and how a model declares its
cache layout (cache_spec). They import nothing from deepinfer, so the engine, the models and the kernels
(tilelang_ops) all import them from below."""
