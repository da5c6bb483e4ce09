"""Works on a copy of the table: the cache never sees the blocks it took."""


def append_slots(table, start, num_new, block_size, pool):
    table = list(table)
    for i in range(start // block_size, (start + num_new - 1) // block_size + 1):
        if i == len(table):
            table.append(pool.allocate())
        elif pool.refcount[table[i]] > 1:
            fresh = pool.allocate()
            pool.copy(table[i], fresh)
            pool.release(table[i])
            table[i] = fresh
    return [(table[p // block_size], p % block_size) for p in range(start, start + num_new)]

EXPECT = ["the table is still []", "change the table the caller passed in place"]
