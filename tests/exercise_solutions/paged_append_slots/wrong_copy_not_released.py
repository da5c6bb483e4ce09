"""Copy-on-write that keeps counting the shared block for this table: it never returns to the pool."""


def append_slots(table, start, num_new, block_size, pool):
    for i in range(start // block_size, (start + num_new - 1) // block_size + 1):
        if i == len(table):
            table.append(pool.allocate())
        elif pool.refcount[table[i]] > 1:
            fresh = pool.allocate()
            pool.copy(table[i], fresh)
            table[i] = fresh
    return [(table[p // block_size], p % block_size) for p in range(start, start + num_new)]

EXPECT = ["block 1 has refcount 2, but 1 table(s) hold it", "release it (pool.release)"]
