"""Runnable jobs: python -m minitrain.examples.mlp (digits MLP) and python -m minitrain.examples.gpt."""
