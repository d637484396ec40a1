"""What a worker's serving path and its upkeep both use, below both (neither imports the
other): what it holds (:mod:`._held`: the entries read, each request's metadata while it
runs, the records answering them, the claims), its model calls (:mod:`._guard`: each
stamped and timed into its bound, and what a worker does about one that runs long or
hangs), the roles the two meet through (:mod:`._roles`: the executor of the model, the
entrance of entries) and the consumer group (:mod:`._consumers`)."""
