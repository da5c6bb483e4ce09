"""One module per exercise (see minitrain/exercises/registry.py for what each defines)."""
