"""KV-cache memory: the paged KV pool (cache.py), the block manager that owns block tables,
ref counts and copy-on-write (block_manager.py), and prefix-cache hashing + LRU eviction
(prefix_cache.py)."""
