"""Layers and models. Models never import comm/ or parallel/: a strategy wraps a model from outside."""
from .module import Module, Parameter
from .layers import Linear, Embedding, LayerNorm, ReLU, GELU, Dropout, Sequential, ModuleList, MLP
from .gpt import GPT, GPTConfig, Block, CausalSelfAttention, FeedForward
from .moe import MoE
from .generation import KVCache, ContiguousKVCache
from . import functional

__all__ = ["Module", "Parameter", "Linear", "Embedding", "LayerNorm", "ReLU", "GELU", "Dropout",
           "Sequential", "ModuleList", "MLP", "GPT", "GPTConfig", "Block", "CausalSelfAttention",
           "FeedForward", "MoE", "KVCache", "ContiguousKVCache", "functional"]
