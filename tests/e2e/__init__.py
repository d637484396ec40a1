"""End-to-end runs: real worker and producer processes, several at once, killed or failed over;
a Redis Cluster."""
