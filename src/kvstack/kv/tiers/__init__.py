"""KV tiers below the memory pool: blocks kept by hash on disk and in Redis, shared across
restarts and processes. `base` is the interface, `codec` the block format, `chain` the
memory -> disk -> Redis order the KV manager restores from and writes through to."""
