"""Datasets (digits, text, synthetic), a batch loader, and DistributedSampler."""
from .digits import load_digits
from .text import load_text, CharCorpus
from .synthetic import make_classification
from .loader import DataLoader
from .sampler import DistributedSampler, share_loss, share_weight, split_sizes

__all__ = ["load_digits", "load_text", "CharCorpus", "make_classification", "DataLoader",
           "DistributedSampler", "share_loss", "share_weight", "split_sizes"]
