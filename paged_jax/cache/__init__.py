"""The paged KV cache, device and host: block pool, page tables, K/V pages and their
quantization as pytrees changed by pure functions; the prefix cache's hash table and LRU
queue; the allocator invariants. Imports nothing above itself (tests/test_structure.py)."""
