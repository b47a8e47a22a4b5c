"""Chat templates rendered apart from the model: ``renderer`` (this process's side), ``worker`` (the renderer's process,
which renders each chat in a child of its own, bounded in time, size and memory), ``frames`` (the messages between them)."""
