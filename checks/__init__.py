"""Checks of the whole pack on this machine: the self-test (``checks/selftest.py``)."""
