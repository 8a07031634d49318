"""Hugging Face models from tiny configs (no dropout: the systems draw different random streams), trained as a user would (`model(input_ids=..., labels=...).loss`), under
zcompile and under FSDP2 (`fully_shard` per block and at the root) with the same init and data."""
from __future__ import annotations

import io

import torch

import zcompile
from tests.workers import reset_dynamo

VOCAB, SEQ, MICRO, STEPS, LR = 256, 16, 2, 4, 1e-2
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# tiny shapes shared by the decoder families: 2 layers, hidden 64, 4 heads (2 KV heads), FFN 128
_DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
FAMILIES = ("llama", "qwen2", "mistral", "gemma", "phi3", "gpt2", "bert", "t5")


def build(family: str, seed: int = 0) -> torch.nn.Module:
    import transformers as tf
    torch.manual_seed(seed)
    if family == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**_DECODER))
    if family == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**_DECODER))
    if family == "mistral":  # sliding-window attention: its KV cache writes a tensor inside each block
        return tf.MistralForCausalLM(tf.MistralConfig(**_DECODER, sliding_window=8))
    if family == "gemma":  # its embeddings are scaled by a constant in the compute dtype
        return tf.GemmaForCausalLM(tf.GemmaConfig(**_DECODER, head_dim=16))
    if family == "phi3":  # fused qkv and gate-up projections
        return tf.Phi3ForCausalLM(tf.Phi3Config(**_DECODER))
    if family == "gpt2":  # Conv1D layers (addmm), learned positions, tied head
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if family == "bert":  # masked LM: post-norm, LayerNorm biases, token types
        return tf.BertForMaskedLM(tf.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                                num_attention_heads=4, intermediate_size=128,
                                                max_position_embeddings=64, hidden_dropout_prob=0.0,
                                                attention_probs_dropout_prob=0.0))
    if family == "t5":  # encoder-decoder with relative position buckets
        return tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128,
                                                         num_layers=2, num_heads=4, decoder_start_token_id=0,
                                                         dropout_rate=0.0))
    raise ValueError(family)


def batch(rank: int) -> dict:
    """This rank's batch, the same every step: a run that learns lowers its loss on it clearly in a few steps."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randint(1, VOCAB, (MICRO, SEQ), generator=g)
    return {"input_ids": x, "labels": x.flip(1)}


def _train(model, rank: int) -> dict:
    """{"losses": per step, "logits": the dtype the model's output came in}."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        out = model(**batch(rank))
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.float().item())
    return {"losses": losses, "logits": out.logits.dtype}


def fsdp2_run(rank: int, family: str, dtype: str) -> dict:
    """The reference: FSDP2 with MixedPrecisionPolicy(param_dtype, reduce fp32), eager."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from zcompile.runtime.dtensor_params import repeated_blocks
    model = build(family)
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32)
    for block in repeated_blocks(model):
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return _train(model, rank)


def zcompile_run(rank: int, family: str, dtype: str, stage: int, backend: str = "eager") -> dict:
    reset_dynamo()
    config = {"stage": stage, "backend": backend, "mixed_precision": {"param_dtype": dtype}}
    model = build(family)
    out = _train(torch.compile(model, backend="zero", options={"config": config}), rank)
    if stage == 0:  # the parameters stay plain: the trained model pickles as the user's own classes
        buf = io.BytesIO()
        torch.save(model, buf)
        loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
        out["pickled"] = [type(m) for m in loaded.modules()] == [type(m) for m in build(family).modules()]
    return out


def matrix(rank: int, world: int, families: list[str], dtype: str, stages: list[int], backend: str = "eager"
           ) -> dict:
    """{family: {"fsdp2": run, stage: run}} on this rank (each run as _train returns it)."""
    return {f: {"fsdp2": fsdp2_run(rank, f, dtype),
                **{s: zcompile_run(rank, f, dtype, s, backend) for s in stages}} for f in families}
