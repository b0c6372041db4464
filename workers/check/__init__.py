"""Checking an artifact against the program run eagerly: the inputs it is checked on (`inputs`),
its numerics (`verify`) and its latency against eager (`benchmark`)."""
