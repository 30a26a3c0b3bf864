"""Starting and supervising a kvlane fleet on one machine: processes, NATS (clustered or not), security, a tiny model.

A library: `kvlane` (the CLI) and `loadtest` build on it; it imports neither.
"""
