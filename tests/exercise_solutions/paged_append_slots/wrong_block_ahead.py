"""Takes the next block as soon as the last one is full, before any token needs it."""


def append_slots(table, start, num_new, block_size, pool):
    for i in range(start // block_size, (start + num_new) // block_size + 1):
        if i == len(table):
            table.append(pool.allocate())
        elif pool.refcount[table[i]] > 1:
            fresh = pool.allocate()
            pool.copy(table[i], fresh)
            pool.release(table[i])
            table[i] = fresh
    return [(table[p // block_size], p % block_size) for p in range(start, start + num_new)]

EXPECT = ["the table holds 6 blocks [0, 1, 2, 3, 4, 5] for 5 tokens", "never ahead"]
