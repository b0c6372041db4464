"""What runs on a worker: load a program, lower it with a backend, verify, benchmark, publish."""
