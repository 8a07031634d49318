"""Imported once by the fork server the test workers fork from (tests/conftest.py sets ZC_WORKER_PRELOAD): what each
worker's first compile would otherwise import and work out again (inductor's code generators, the cache key's hash of
torch's sources, transformers' model classes): 2-5 s of every world's start on 2 cores. Nothing here starts a
thread, and on a CUDA or ROCm build nothing queries the device (the server forks after it: a child of a process
that initialized CUDA cannot use it)."""
import torch
import torch._dynamo
import torch._functorch.aot_autograd
import torch._inductor.codegen.memory_planning
import torch._inductor.compile_fx
import torch._inductor.cpp_builder
import torch._inductor.hooks
import torch.distributed.fsdp
import torch.distributed.tensor.experimental
import torch.export
import torch.utils.cpp_extension  # setuptools and distutils, which inductor's C++ builds import

import zcompile.compiler.codegen.inductor

if torch.version.cuda is None and torch.version.hip is None:
    from torch._inductor import codecache
    from torch._inductor.codegen.common import init_backend_registration

    init_backend_registration()
    codecache.torch_key()
    codecache.CacheBase.get_system()

try:  # the Hugging Face models the tests build from configs
    import transformers  # noqa: F401
    from transformers import (BertForMaskedLM, DeepseekV3ForCausalLM, GemmaForCausalLM,  # noqa: F401
                              GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM,
                              Phi3ForCausalLM, Qwen2ForCausalLM, Qwen3MoeForCausalLM, T5ForConditionalGeneration)
    from transformers.integrations import moe  # noqa: F401
except ImportError:
    pass
