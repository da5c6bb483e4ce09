"""Exercises graded by minitrain's own tests: ``python -m minitrain.exercises check NAME PATH``.

``python -m minitrain.exercises list`` shows them; ``stub NAME DEST`` copies the starting file
(signature, docstring, the parts to write marked ``EXERCISE``). The checks are the ones the
library's own implementation passes (an adapter, as in Stanford CS336): ``--reference`` grades
minitrain's implementation with the same checks.
"""
