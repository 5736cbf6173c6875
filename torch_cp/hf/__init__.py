"""The Hugging Face bridge: validate and patch a transformers model, the paged ``Cache`` its
forward receives, and ``model.generate`` over it."""

from torch_cp.hf.cache import PagedKVCache
from torch_cp.hf.model_generate import GenerateCache, install_generate, new_cache
from torch_cp.hf.patch import patch_model, unpatch_model

__all__ = ["GenerateCache", "PagedKVCache", "install_generate", "new_cache", "patch_model",
           "unpatch_model"]
