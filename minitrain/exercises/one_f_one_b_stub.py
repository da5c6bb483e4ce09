"""Exercise: the 1F1B pipeline schedule (PipeDream-Flush, Narayanan et al. 2021).

Write ``one_f_one_b(p, m)``: for each of the p stages, the ordered list of what it computes for
m micro-batches, as tuples ``("F", i)`` (forward of micro-batch i) and ``("B", i)`` (backward).
Stage s receives its forward input from stage s-1 and its backward gradient from stage s+1, so an
action can only run once those exist. The schedule must

  * never deadlock and keep every backward after its forward (the checker runs it abstractly),
  * have GPipe's bubble, (p-1)/(m+p-1) with forward cost 1 and backward cost 2,
  * keep at most min(p - s, m) micro-batches in flight on stage s (GPipe keeps all m).

The plan: stage s first runs w = min(p - s - 1, m) forwards (warm-up), then alternates one forward
and one backward until the forwards are done, then runs the remaining backwards (cool-down). Each
kind goes in micro-batch order.

Check it:  python -m minitrain.exercises check one_f_one_b path/to/this_file.py
"""


def one_f_one_b(p, m):
    schedule = []
    for s in range(p):
        actions = []
        # EXERCISE: warm-up forwards, then one forward / one backward, then the remaining backwards.
        raise NotImplementedError("one_f_one_b: write the warm-up, steady and cool-down phases")
        schedule.append(actions)
    return schedule
