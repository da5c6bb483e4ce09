"""The copy goes the wrong way: the fresh, empty block is copied over the shared one."""


def append_slots(table, start, num_new, block_size, pool):
    for i in range(start // block_size, (start + num_new - 1) // block_size + 1):
        if i == len(table):
            table.append(pool.allocate())
        elif pool.refcount[table[i]] > 1:
            fresh = pool.allocate()
            pool.copy(fresh, table[i])
            pool.release(table[i])
            table[i] = fresh
    return [(table[p // block_size], p % block_size) for p in range(start, start + num_new)]

EXPECT = ["sequence 0 reads nothing at its position 4", "pool.copy(src=shared, dst=fresh)"]
