"""The test models that workers serve (models_for_tests.py, imported by name by worker
subprocesses and by scripts/ as ``tests.service.models_for_tests``), a replicated Redis
(replicated.py, which scripts/failover.py imports too), and the short runs of scripts/chaos.py
and scripts/keda_sim.py. The other tests of the service are in the folder of the package they
test; their fixtures are in tests/support/service.py.
"""
