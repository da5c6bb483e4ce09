"""A learner's append_slots, written from the hints: first every block the new tokens need, then the slots."""


def append_slots(table, start, num_new, block_size, pool):
    first, last = start // block_size, (start + num_new - 1) // block_size
    for i in range(first, last + 1):
        if i == len(table):
            table.append(pool.allocate())
        elif pool.refcount[table[i]] > 1:
            mine = pool.allocate()
            pool.copy(table[i], mine)
            pool.release(table[i])
            table[i] = mine
    slots = []
    for p in range(start, start + num_new):
        slots.append((table[p // block_size], p % block_size))
    return slots
