"""Offsets counted from the call's first token instead of the sequence's: a decode step writes offset 0."""


def append_slots(table, start, num_new, block_size, pool):
    for i in range(start // block_size, (start + num_new - 1) // block_size + 1):
        if i == len(table):
            table.append(pool.allocate())
        elif pool.refcount[table[i]] > 1:
            fresh = pool.allocate()
            pool.copy(table[i], fresh)
            pool.release(table[i])
            table[i] = fresh
    return [(table[p // block_size], (p - start) % block_size) for p in range(start, start + num_new)]

EXPECT = ["the slot of position", "at offset p % block_size"]
