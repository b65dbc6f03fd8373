"""A researcher's own Flax NNX model on the paged KV cache.

    from paged_jax.nn import PagedAttention, RaggedStep      the layer and the step it reads
    from paged_jax.nn.llama import LlamaForCausalLM           our Llama decoder, in NNX
    LLM(model=my_module, tokenizer="smollm2")                 served by the engine

interface.py says what a model provides; engine_forward.py turns a module into the params
and pure forward the engine runs. Importing this package imports flax; the rest of paged_jax
does not need it.
"""

from paged_jax.nn.attention import PagedAttention
from paged_jax.nn.engine_forward import ModuleForward, split_model
from paged_jax.nn.interface import PagedModel, RaggedStep, check_model

__all__ = ["ModuleForward", "PagedAttention", "PagedModel", "RaggedStep", "check_model",
           "split_model"]
