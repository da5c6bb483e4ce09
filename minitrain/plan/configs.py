"""Named model configurations for "python -m minitrain.plan gpt --model NAME" (their sizes as the planner's options).

minitrain's GPT is nanoGPT's: learned positions, LayerNorm, multi-head attention, a GELU MLP of two
matrices. What these models do otherwise is not modelled, and said so: grouped-query attention
(Mixtral's 8 KV heads are planned as 32 full heads: more K/V bytes and FLOPs than the real model),
SwiGLU's third matrix (each expert is 2·h·f, not 3·h·f: about 2/3 of the real expert parameters),
DeepSeek-V3's multi-head latent attention (planned as plain MHA of 128 heads), its first three dense
layers (every layer here is MoE) and its multi-token prediction; Mixtral's vocabulary and the rotary
positions change only the embeddings.

mixtral-8x7b (Jiang et al. 2024): 32 layers, h 4096, 32 heads, 8 experts top-2 of FFN 14336 in every
layer, vocab 32000, seq 4096. deepseek-v3 (DeepSeek-AI 2024): 61 layers, h 7168, 128 heads, 256 routed
experts top-8 of FFN 2048 + 1 shared, vocab 129280, seq 4096. Both in bf16 on 1024 GPUs by default
(H100 80GB's constants: machines/h100-80gb.json), with a global batch of 1024 sequences.
"""

NAMED = {
    "mixtral-8x7b": dict(n_layer=32, n_embd=4096, n_head=32, block_size=4096, vocab_size=32000, ffn_hidden=14336,
                         moe_experts=8, moe_top_k=2, moe_every=1, batch_size=1024, world=1024, precision="bf16",
                         machine="h100-80gb"),
    "deepseek-v3": dict(n_layer=61, n_embd=7168, n_head=128, block_size=4096, vocab_size=129280, ffn_hidden=18432,
                        expert_hidden=2048, moe_experts=256, moe_top_k=8, moe_shared=1, moe_every=1,
                        batch_size=1024, world=1024, precision="bf16", machine="h100-80gb"),
}
