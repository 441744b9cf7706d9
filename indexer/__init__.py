"""Pure routing logic shared by workers and router: the event wire protocol, block hashing,
the prefix index. Nothing here does I/O."""
