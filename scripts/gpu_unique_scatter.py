"""A pytest plugin for scripts/gpu_tests.sh: every `.at[...].set` scatter is marked as writing
each in-bounds index once (unique_indices), which XLA:GPU's deterministic scatter rewrite leaves
alone. jaxkv's cache writes are such scatters (a slot per token; padded tokens and rejected tree
nodes go past the end, dropped), so this tries the candidate fix before it is made:
  pytest -p scripts.gpu_unique_scatter tests/test_speculative.py"""

from jax._src.lax import slicing

_scatter = slicing.scatter


def _unique_scatter(operand, scatter_indices, updates, dimension_numbers, *,
                    indices_are_sorted=False, unique_indices=False, mode=None):
    return _scatter(operand, scatter_indices, updates, dimension_numbers,
                    indices_are_sorted=indices_are_sorted, unique_indices=True, mode=mode)


slicing.scatter = _unique_scatter
