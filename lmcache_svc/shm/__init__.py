"""The shared-memory formats both sides map: the arena segment (``arena``) with its
slab allocator (``slab``), and the lookup index tables (``lookup_index``). The server
creates and writes them; clients map them (the arena read-write, the tables read-only)."""
