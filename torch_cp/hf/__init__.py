"""The Hugging Face bridge: validate and patch a transformers model (or load one sharded,
``from_pretrained``), the paged ``Cache`` its forward receives, and ``model.generate`` over it."""

from torch_cp.hf.cache import PagedKVCache
from torch_cp.hf.load import from_pretrained
from torch_cp.hf.model_generate import GenerateCache, install_generate, new_cache
from torch_cp.hf.patch import patch_model, unpatch_model

__all__ = ["GenerateCache", "PagedKVCache", "from_pretrained", "install_generate", "new_cache",
           "patch_model", "unpatch_model"]
