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
# mixture of experts: 3-D expert weights, data-dependent routing; the library's default experts implementation
MOE_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")
_MOE = dict(num_experts_per_tok=2)


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
    if family in ("mixtral", "mixtral_eager_experts"):  # the second loops over the experts its tokens hit
        impl = {"experts_implementation": "eager"} if family == "mixtral_eager_experts" else {}
        return tf.MixtralForCausalLM(tf.MixtralConfig(**_DECODER, **_MOE, num_local_experts=4, **impl))
    if family == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**_DECODER, **_MOE, num_experts=4, moe_intermediate_size=64,
                                                        head_dim=16))
    if family == "deepseek_v3":  # multi-head latent attention, a dense first layer, a shared expert
        return tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            **_DECODER, **_MOE, n_routed_experts=4, moe_intermediate_size=64, first_k_dense_replace=1, n_group=1,
            topk_group=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16))
    raise ValueError(family)


def batch(rank: int) -> dict:
    """This rank's batch, the same every step: a run that learns lowers its loss on it clearly in a few steps."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randint(1, VOCAB, (MICRO, SEQ), generator=g)
    return {"input_ids": x, "labels": x.flip(1)}


def _train(model, rank: int) -> dict:
    """{"losses": per step, "logits": the dtype the model's output came in, "recompiled": graphs dynamo compiled
    after the first step (the same batch every step: none expected)}."""
    from torch._dynamo.utils import counters
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        out = model(**batch(rank))
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.float().item())
        if step == 0:
            first = counters["stats"]["unique_graphs"]
    return {"losses": losses, "logits": out.logits.dtype, "recompiled": counters["stats"]["unique_graphs"] - first}


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


def zcompile_run(rank: int, family: str, dtype: str, stage: int, backend: str = "eager", bare_reset: bool = False
                 ) -> dict:
    """`bare_reset`: compile right after a bare torch._dynamo.reset(), which drops zcompile's compile-start hook:
    the backend shards what the first trace read and restarts it (the path torch 2.11 always takes)."""
    torch._dynamo.reset() if bare_reset else reset_dynamo()
    config = {"stage": stage, "backend": backend, "mixed_precision": {"param_dtype": dtype}}
    model = build(family)
    out = _train(torch.compile(model, backend="zero", options={"config": config}), rank)
    if stage == 0:  # the parameters stay plain: the trained model pickles as the user's own classes
        buf = io.BytesIO()
        torch.save(model, buf)
        loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
        out["pickled"] = [type(m) for m in loaded.modules()] == [type(m) for m in build(family).modules()]
    return out


def matrix(rank: int, world: int, families: list[str], dtype: str, stages: list[int], backend: str = "eager",
           bare_reset: bool = False) -> dict:
    """{family: {stage: run}} on this rank (each run as _train returns it)."""
    return {f: {s: zcompile_run(rank, f, dtype, s, backend, bare_reset) for s in stages} for f in families}


def fsdp2_runs(rank: int, world: int, family: str, dtype: str) -> dict:
    """FSDP2's run of `family` on this rank, the reference of every zcompile run of that family and dtype."""
    return fsdp2_run(rank, family, dtype)


def unused_expert_grads(rank: int, world: int, stage: int) -> list[dict]:
    """Mixtral at `stage` (bf16) with every router's choices folded onto experts 0-2: per expert weight, the
    gradient after one backward, whole, as a list per expert of (is it all zeros)."""
    from transformers.models.mixtral import modeling_mixtral as mm
    route = mm.MixtralTopKRouter.forward

    def folded(self, hidden_states):  # on the class: the blocks stay alike (one region)
        logits, scores, indices = route(self, hidden_states)
        return logits, scores, indices % 3
    mm.MixtralTopKRouter.forward = folded
    reset_dynamo()
    model = build("mixtral")
    compiled = torch.compile(model, backend="zero",
                             options={"config": {"stage": stage, "mixed_precision": {"param_dtype": "bf16"}}})
    compiled(**batch(rank)).loss.backward()
    out = []
    for name, p in model.named_parameters():
        if "experts" in name:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out.append({"name": name, "zero": [bool((g[e] == 0).all()) for e in range(g.shape[0])]})
    return out


def embeds_matrix(rank: int, world: int, cast: bool = True, backend: str = "eager") -> dict:
    """Llama in bf16 called with fp32 `inputs_embeds` (the same every step): per system the losses of four AdamW
    steps and the dtype of the hidden states its first decoder layer received. `cast`: zcompile's
    mixed_precision.cast_forward_inputs."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from zcompile.runtime.dtensor_params import repeated_blocks
    g = torch.Generator().manual_seed(200 + rank)
    embeds = torch.randn(MICRO, SEQ, _DECODER["hidden_size"], generator=g)
    labels = batch(rank)["labels"]
    out = {}
    for system in ("fsdp2", "zcompile"):
        reset_dynamo()
        model = build("llama")
        seen = []
        model.model.layers[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
        if system == "fsdp2":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in repeated_blocks(model):
                fully_shard(block, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
            run = model
        else:
            # the head and loss as FSDP2 runs them (the chunked op sums in fp32: ~2e-5 apart after four steps)
            run = torch.compile(model, backend="zero", options={"config": {
                "stage": 3, "backend": backend, "chunked_loss": {"enabled": False},
                "mixed_precision": {"param_dtype": "bf16", "cast_forward_inputs": cast}}})
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = []
        for _ in range(STEPS):
            loss = run(inputs_embeds=embeds, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.float().item())
        out[system] = {"losses": losses, "seen": seen[0] if seen else None}
    return out


def use_cache_run(rank: int, world: int, family: str) -> dict:
    """A 4-layer Llama or a 3-layer T5 trained at stage 3 as a user calls it, the config's default `use_cache=True`, with the
    blocks traced once (True) and inline (False): per way, the losses, the KV cache the last forward returned (its
    layers' shapes and sums; T5's self- and cross-attention caches and which layers are marked updated) and, per
    graph dynamo handed the backend, its region calls and distinct region bodies."""
    import transformers as tf
    from zcompile.compiler.tracing import trace_blocks_once as tbo
    seen, inline = [], tbo.inline

    def counting(gm, **kwargs):
        calls = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
        if calls:  # (a region's own body comes here too)
            seen.append((len(calls), len({id(getattr(gm, n.args[0].target)) for n in calls})))
        return inline(gm, **kwargs)

    def layers(cache) -> list:
        return [(tuple(layer.keys.shape), layer.keys.sum().item(), layer.values.sum().item())
                for layer in cache.layers]

    tbo.inline = counting
    out = {}
    try:
        for once in (True, False):
            seen.clear()
            reset_dynamo()
            torch.manual_seed(0)
            if family == "t5":
                model = tf.T5ForConditionalGeneration(tf.T5Config(
                    vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=3, num_heads=4,
                    decoder_start_token_id=0, dropout_rate=0.0))
            else:
                model = tf.LlamaForCausalLM(tf.LlamaConfig(**{**_DECODER, "num_hidden_layers": 4}))
            assert model.config.use_cache
            run = torch.compile(model, backend="zero", options={"config": {
                "stage": 3, "backend": "eager", "trace_blocks_once": once}})
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
            losses = []
            for _ in range(3):
                res = run(**batch(rank))
                res.loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(res.loss.item())
            cache = res.past_key_values
            out[once] = {"losses": losses, "seen": list(seen)}
            if family == "t5":
                out[once]["cache"] = {"self": layers(cache.self_attention_cache),
                                      "cross": layers(cache.cross_attention_cache), "updated": dict(cache.is_updated)}
            else:
                out[once]["cache"] = layers(cache)
        return out
    finally:
        tbo.inline = inline
