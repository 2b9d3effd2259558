"""``sims.scale``: attrindex at 10M-1B keys in one index, in bounded memory or not (issue 27).

``run`` is the harness (attrindex against RocksDB, each in its own process, every process's RSS
sampled); ``profile`` the memory profile of each operation; ``rlimit`` the recipe for a child
process under an address-space limit. See sims/README.md, "sims/scale".
"""
