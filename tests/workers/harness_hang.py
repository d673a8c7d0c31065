"""A rank that says it started, then hangs: tests/test_spawn_harness.py checks that run_ranks
ends the whole job (mpirun and every rank) when it outlives its timeout."""
import time

print("harness_hang: started", flush=True)
while True:
    time.sleep(0.1)
