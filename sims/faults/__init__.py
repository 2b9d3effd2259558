"""Fault soaks: the corruption fuzz and the kill-loop history soak at scale (``python -m sims.faults.run``).

The trial machinery lives here and the test suite imports it (tests/test_corruption_fuzz.py,
tests/test_fault_history.py): one copy of the logic, run small in CI and large here.
"""
