"""The KV core: block hashes, the prefix index, the block ledger and its allocation rules, step-time profiles, KV links.

Pure or Redis-script logic that the balancer, the cache-manager, the workers and the simulator share.
"""
