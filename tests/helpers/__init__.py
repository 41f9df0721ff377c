"""Helpers shared by the test files: models, data and single-process references.

``tests.helpers.fsdp`` serves the impl.fsdp tests, ``tests.helpers.zero`` the impl.zero
tests. Test files import from here, never from one another; ``tests/conftest.py``
makes the package importable. The rank harness itself is ``zerobench.harness.testing``.
"""
