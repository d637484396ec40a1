"""What keeps a worker and its queue healthy beside the serving path: the janitor (its claims
kept alive), the reclaimer (entries of dead workers taken over), the heartbeat (its entry in
the queue's worker set), the removal of dead consumers, and the watchdog (a model call that
runs too long) with the guard that acts on it."""
