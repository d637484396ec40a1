"""The test suite: one folder per package of batchline (core, drivers, generation, transport,
producer, worker, contrib, cli, demo; wire for keys, codec and acl), multi-process runs in e2e,
the documentation in docs, shared helpers and fixtures in support. A package, so that every
test module has a name of its own and imports its helpers as ``tests.support.*``."""
