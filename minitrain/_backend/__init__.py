"""The parts of minitrain.backend, one idea per module. Use them as backend.X (backend.py
re-exports every name); only backend.py imports this package.

    switch.py   which array module (NumPy or CuPy) and which GPU: the one copy of that state
    moves.py    host <-> device copies and synchronisations, counted; GPU events
    arrays.py   what NumPy and CuPy spell differently: scatter-add, GPU draws, memory views
    host.py     the host: local rank, BLAS threads, host memory held between steps
    dtypes.py   the default floating dtype, bfloat16 and the 16-bit dtypes
"""
