"""`kvlane simulate`: the fleet in virtual time, one process, kvlane's own routing and allocation code inside.

See `loadtest/simulation/world.py` for what is simulated and how, and
`loadtest/simulation/command.py` for the command line.
"""
