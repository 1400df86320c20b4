"""Shared by the paged-KV core tests (test_paged_pool.py, test_paged_storage.py, test_paged_groups.py)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from mlx_infer._fast import PagePool


def make(num_pages=6, page_size=4):
    return PagePool(num_pages=num_pages, page_size=page_size)


# The state machines' pools (test_paged_storage.py's PoolMachine, test_paged_groups.py's GroupsMachine).
NUM_PAGES = 20
PAGE_SIZE = 2
BASES = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [5, 5, 5, 5, 5])


def machine_settings(max_examples: int) -> settings:
    """The stateful machines' hypothesis settings: ``max_examples`` runs of 50 steps, no deadline."""
    return settings(max_examples=max_examples, stateful_step_count=50, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
