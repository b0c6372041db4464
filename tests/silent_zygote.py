"""A sandbox zygote whose children never say they are ready (tests/test_sandbox_children.py).

    python -m tests.silent_zygote CONTROL_FD DEVICE
"""
import time

from workers.sandbox import zygote

zygote._child = lambda *args: time.sleep(3600)

if __name__ == "__main__":
    zygote.main()
