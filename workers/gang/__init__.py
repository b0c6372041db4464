"""Gangs: the ranks of a multi-rank model compiled together. A rank reads its graph (`rank`), the
ranks agree through compiler collectives on what they saw (`collectives`, `steps`) and on
autotuning (`tune`), rank 0 of identical ranks may compile while the others start (`early`), and
the process group forms through one store (`rendezvous`)."""
