"""How the CuPy backend picks its path to MPI (pure rules; no GPU needed)."""

from __future__ import annotations

import pytest

from summasim.backends.cupy_backend import GPU_COMM_MODES, choose_mode


def test_a_cuda_aware_mpi_takes_device_pointers():
    assert choose_mode("", True, "MPIX_Query_cuda_support() = 1", 4, 4) == (
        "direct", "MPIX_Query_cuda_support() = 1")


def test_one_node_without_a_cuda_aware_mpi_goes_device_to_device():
    mode, why = choose_mode("", False, "MPIX_Query_cuda_support() = 0", 4, 4)
    assert mode == "ipc" and "one node" in why and "= 0" in why


def test_several_nodes_without_a_cuda_aware_mpi_stage():
    mode, why = choose_mode("", False, "no CUDA support", 4, 8)
    assert mode == "staged" and "several nodes" in why


@pytest.mark.parametrize("forced", GPU_COMM_MODES)
def test_the_environment_forces_any_mode(forced):
    assert choose_mode(forced, True, "", 1, 8) == (forced, "forced by SUMMASIM_GPU_COMM")


def test_an_unknown_forced_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="SUMMASIM_GPU_COMM='nccl'.*staged, direct, ipc"):
        choose_mode("nccl", False, "", 4, 4)
