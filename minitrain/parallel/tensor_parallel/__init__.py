"""Tensor parallelism (Shoeybi et al. 2019, "Megatron-LM", sec. 3, Figures 3-4) and sequence
parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", sec. 4.2), in three rooms and an annex:

  comms.py    the communication: Megatron's f (identity forward, all-reduce backward) and g
              (all-reduce forward, identity backward), and their sequence-parallel forms
              (all-gather / reduce-scatter along the sequence);
  layers.py   the layers built on them: ColumnParallelLinear, RowParallelLinear,
              VocabParallelEmbedding, VocabParallelCrossEntropy, ParallelDropout;
  gpt.py      the GPT with those layers put in (TensorParallelGPT, tensor_parallelize), and the
              derivation of its saved activations per layer;
  moe.py      its MoE layers, replicated on the tp ranks, and their figures in GPT3D's pipeline.

The MLP Y = GeLU(X A) B: A split by columns (each of t ranks computes GeLU(X A_r), no
communication: GeLU is elementwise), B by rows (each computes a partial sum GeLU(X A_r) B_r; g adds
them). Attention splits the same way by heads. A transformer layer costs 2 all-reduces forward and
2 backward, 2(t-1)/t of the activation (s·b·h elements) each per rank; sequence parallelism sends
the same bytes and divides the replicated activations by t.
"""
from .comms import (CopyToTensorParallelRegion, GatherFromSequenceParallelRegion, GatherFromTensorParallelRegion,
                    ReduceFromTensorParallelRegion, ReduceScatterToSequenceParallelRegion, f, g)
from .gpt import ParallelAttention, ParallelBlock, ParallelMLP, TensorParallelGPT, tensor_parallelize
from .layers import (AllGatherLinear, ColumnParallelLinear, ParallelDropout, RowParallelLinear, VocabParallelCrossEntropy,
                     VocabParallelEmbedding, positions)

__all__ = ["CopyToTensorParallelRegion", "ReduceFromTensorParallelRegion", "GatherFromSequenceParallelRegion",
           "ReduceScatterToSequenceParallelRegion", "GatherFromTensorParallelRegion", "f", "g",
           "AllGatherLinear", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "VocabParallelCrossEntropy", "ParallelDropout", "positions",
           "ParallelAttention", "ParallelMLP", "ParallelBlock", "TensorParallelGPT", "tensor_parallelize"]
