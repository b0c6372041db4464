"""A sandbox zygote that never forks the child asked for, as one still waiting for an earlier
child to exit would (tests/test_sandbox_children.py).

    python -m tests.unforking_zygote CONTROL_FD DEVICE
"""
import os
import time

from workers.sandbox import zygote

os.fork = lambda: time.sleep(3600)

if __name__ == "__main__":
    zygote.main()
