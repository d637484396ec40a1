"""What keeps a worker and its queue healthy beside the serving path (:mod:`._upkeep`): the
janitor (its claims kept alive, dead consumers removed), the reclaimer (entries of dead
workers taken over, handed to the serving path as its entrance), the heartbeat (its entry in
the queue's worker set, its statistics) and the watchdog (:mod:`._watchdog`: a model call
that runs too long, against the bound kept by the guard in :mod:`batchline.worker.shared`).
It never imports the serving path, nor the serving path it."""
